"""The real service over HTTP: SQLite and PostgreSQL stores, the in-process executor, tiny
real checkpoints under an allowed root."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import create_engine, text

from core import jobs
from core.db.migrate import upgrade
from core.db.session import Database
from core.jobs import Executor
from core.settings import Settings
from layerswap.app import build_app
from service.app import create_app
from tests.helpers import wait_for
from worker.lease import JobLease

POSTGRES_ADMIN = os.environ.get(
    "LAYERSWAP_TEST_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
TERMINAL = {"succeeded", "failed", "canceled"}


@contextmanager
def postgres_database(admin_url: str = POSTGRES_ADMIN) -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards (on the machine's
    server, or on the one `admin_url` names)."""
    name = f"layerswap_test_{uuid.uuid4().hex[:12]}"
    # pre-ping: a test may have restarted PostgreSQL since the CREATE.
    admin = create_engine(admin_url, isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    with admin.connect() as connection:
        connection.execute(text(f'CREATE DATABASE "{name}"'))
    try:
        yield admin_url.rsplit("/", 1)[0] + f"/{name}"
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Running merges wait at their cancel checks until the gate opens (at the latest when
    the test ends); their heartbeats go on, from a thread of their own."""
    opened = threading.Event()
    check = JobLease.should_cancel

    def held(lease: JobLease) -> bool:
        opened.wait(timeout=120)
        return check(lease)

    monkeypatch.setattr(JobLease, "should_cancel", held)
    yield opened
    opened.set()


@pytest.fixture
def postgres_url() -> Iterator[str]:
    with postgres_database() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgres"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'layerswap.db'}"
    else:
        with postgres_database() as url:
            yield url


@dataclass
class Service:
    client: TestClient
    settings: Settings
    db: Database
    checkpoints: Path  # the allowed source root, holding base/ math/ swh/

    def submit(self, body: dict[str, Any], **headers: str) -> dict[str, Any]:
        response = self.client.post("/v1/merges", json=body, headers=headers)
        assert response.status_code == 202, response.text
        return dict(response.json())

    def wait(self, job_id: str, *, kind: str = "merges", timeout: float = 120.0) -> dict[str, Any]:
        """Poll until the job is finished (fails the test at the deadline)."""
        seen: list[dict[str, Any]] = []

        def ended() -> dict[str, Any] | None:
            seen[:] = [dict(self.client.get(f"/v1/{kind}/{job_id}").json())]
            return seen[0] if seen[0]["status"] in TERMINAL else None

        def still() -> str:
            return f"job {job_id} to end (still {seen[0]['status']})"

        return wait_for(ended, still, timeout, interval=0.05)


def make_settings(root: Path, url: str, **overrides: Any) -> Settings:
    data = root / "data"
    checkpoints = data / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    values: dict[str, Any] = {
        "data_dir": data,
        "database_url": url,
        "allowed_roots": [checkpoints, data / "artifacts"],
        "progress_interval_s": 0.05,
        "heartbeat_interval_s": 0.1,  # cancels are seen within a tenth of a second
        "reconcile_interval_s": 0.25,
        # TestClient sends `Host: testserver`; the loopback names are the default ones.
        "trusted_hosts": ["localhost", "127.0.0.1", "::1", "testserver"],
    }
    return Settings(**{**values, **overrides})


@contextmanager
def running_service(
    root: Path,
    url: str,
    examples: Path,
    *,
    job_executor: Executor | None = None,
    **overrides: Any,
) -> Iterator[Service]:
    """The app on `url`; `job_executor` replaces the local executor (e.g. one that never
    runs jobs, so they stay queued)."""
    settings = make_settings(root, url, **overrides)
    checkpoints = settings.source_roots[0]
    for name in ("base", "math", "swh"):
        if not (checkpoints / name).exists():
            shutil.copytree(examples / name, checkpoints / name)
    upgrade(settings.database)
    if job_executor is None:
        app = build_app(settings)  # the executor the settings name, as `layerswap serve` has
    else:
        app = create_app(settings, executor=job_executor)
    with TestClient(app) as client:
        yield Service(client, settings, app.state.context.db, checkpoints)


@pytest.fixture
def service(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples) as running:
        yield running


def layer_swap(**params: Any) -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": ["math"], "language": ["swh"]},
        "params": {"bottom": 1, "top": 1, **params},
    }


# --- stores: a migrated database with its tenant, no app and no executor --------------------
TENANT = "default"


@contextmanager
def open_store(tmp_path: Path, url: str) -> Iterator[tuple[Database, Settings]]:
    """A migrated store at `url` with its tenant, and no executor running."""
    settings = make_settings(tmp_path, url)
    upgrade(url)
    db = Database(url)
    jobs.ensure_tenant(db, TENANT)
    try:
        yield db, settings
    finally:
        db.dispose()


@pytest.fixture
def store(tmp_path: Path, database_url: str) -> Iterator[tuple[Database, Settings]]:
    """On SQLite and on PostgreSQL."""
    with open_store(tmp_path, database_url) as opened:
        yield opened


@pytest.fixture
def pg_store(tmp_path: Path, postgres_url: str) -> Iterator[tuple[Database, Settings]]:
    with open_store(tmp_path, postgres_url) as opened:
        yield opened
