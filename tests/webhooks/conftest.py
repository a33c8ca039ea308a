from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core import jobs
from core.db.session import Database
from core.webhooks.outbox import emit
from service.auth import create_key
from tests.evaluation.conftest import math_expert
from tests.service.conftest import Service, database_url, running_service
from tests.webhooks.receiver import Receiver

# Loopback is where the test receiver listens; the service refuses it unless allowed.
# SQLite and PostgreSQL, as for the service tests; the evaluation tests' model and data.
__all__ = ["database_url", "math_expert"]

FAST: dict[str, Any] = {
    "webhook_allowed_networks": ["127.0.0.0/8"],
    "webhook_interval_s": 0.05,
    "webhook_retry_base_s": 0.2,
    "webhook_timeout_s": 2.0,
    "public_url": "https://layerswap.example",
}


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


@pytest.fixture
def service(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples, **FAST) as running:
        yield running


def subscribe(service: Service, receiver: Receiver, **body: Any) -> dict[str, Any]:
    response = service.client.post("/v1/webhooks", json={"url": receiver.url, **body})
    assert response.status_code == 201, response.text
    created = dict(response.json())
    receiver.secrets.append(created["secret"])
    return created


def announce(db: Database, tenant: str, one_off_url: str | None = None) -> str:
    """A job of `tenant` ends: its event is written to the outbox, in one transaction, as a
    merge's end writes it (without running a merge). Returns the job id the event names."""
    jobs.ensure_tenant(db, tenant)
    job_id = uuid.uuid4().hex
    data = {"id": job_id, "object": "merge", "status": "succeeded",
            "links": {"self": f"/v1/merges/{job_id}"}}  # fmt: skip
    with db.session() as session:
        emit(session, tenant=tenant, type_="merge.succeeded", subject_id=job_id, data=data,
             one_off_url=one_off_url)  # fmt: skip
    return job_id


def tenant_headers(service: Service, *tenants: str) -> dict[str, dict[str, str]]:
    """An API key for each tenant, as request headers (the service runs with auth on)."""
    return {t: {"Authorization": f"Bearer {create_key(service.db, t)}"} for t in tenants}
