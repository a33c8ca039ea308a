"""The abuse suite runs on both stores: the service tests' parametrised `database_url` (SQLite
and PostgreSQL), re-exported for every module here; and, for tests that only send requests and
judge the answers, one service on loopback per store that they share (`http_client`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.service.conftest import database_url, postgres_database, postgres_url
from tests.service.live import Live, live_service
from tests.service.test_api_lifecycle import HeldExecutor

__all__ = ["database_url", "postgres_url"]


@pytest.fixture(scope="package", params=["sqlite", "postgres"])
def shared_database_url(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """database_url's two stores, each made once for the tests here that share a service."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('store') / 'layerswap.db'}"
    else:
        with postgres_database() as url:
            yield url


@pytest.fixture(scope="package")
def loopback_service(
    shared_database_url: str, tmp_path_factory: pytest.TempPathFactory, examples: Path
) -> Iterator[Live]:
    """One service over HTTP on loopback per store, shared by the tests that ask for it (each
    judges only what it sent): jobs held queued, webhooks allowed to name loopback."""
    root = tmp_path_factory.mktemp("service")
    with live_service(
        root, shared_database_url, examples, job_executor=HeldExecutor(),
        webhook_allowed_networks=["127.0.0.0/8"],
    ) as running:  # fmt: skip
        yield running


@pytest.fixture(scope="package")
def http_client(loopback_service: Live) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=loopback_service.url, timeout=60) as client:
        yield client
