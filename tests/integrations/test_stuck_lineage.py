"""An OpenLineage backend that accepts connections and then never answers, or answers one byte
per second, against the real service with every timing setting at its default: the merge
succeeds on its first attempt (the lineage call is bounded and off the path that proves the
worker alive), and the event that could not be sent is abandoned and logged."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import pytest

from tests.service.conftest import layer_swap, running_service
from tests.stuck_server import Mode, StuckServer
from tests.webhooks.receiver import wait_for

LOGGER = "layerswap.openlineage"


def lineage_warnings(caplog: pytest.LogCaptureFixture, job_id: str) -> list[str]:
    return [
        r.getMessage() for r in list(caplog.records)
        if r.name == LOGGER and r.levelno >= logging.WARNING and job_id in r.getMessage()
    ]  # fmt: skip


@pytest.mark.parametrize("mode", ["silent", "drip"])
def test_a_stuck_lineage_backend_neither_fails_nor_stalls_a_merge(
    tmp_path: Path, examples: Path, caplog: pytest.LogCaptureFixture, mode: Mode
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with (
        StuckServer(mode) as backend,
        running_service(
            tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
            openlineage_url=backend.url, stale_after_s=30.0, heartbeat_interval_s=2.0,
            reconcile_interval_s=5.0,
        ) as service,
    ):  # fmt: skip
        job = service.wait(service.submit(layer_swap())["id"], timeout=120)
        assert job["status"] == "succeeded", job["error"]
        assert job["attempts"] == 1
        events = service.client.get(f"/v1/merges/{job['id']}/events").json()
        assert [e["type"] for e in events].count("running") == 1  # never taken for dead
        # The START event reached the backend and was given up on, said in the log.
        backend.wait_for(lambda b: b.requests, "lineage request", timeout=30)
        assert b"POST /api/v1/lineage" in backend.requests[0]
        found = wait_for(
            lambda: lineage_warnings(caplog, job["id"]), "abandoned lineage event", timeout=60
        )
        assert any("START event not sent" in m and "within 10 s" in m for m in found), found
        # The next job does not wait for the stuck backend either; with two sends still hanging
        # there, its events are not even tried (no more threads pile up on the backend).
        second = service.wait(service.submit({**layer_swap(), "output": {"name": "two"}})["id"])
        assert second["status"] == "succeeded" and second["attempts"] == 1
        refused = wait_for(
            lambda: lineage_warnings(caplog, second["id"]), "dropped lineage event", timeout=60
        )
        assert any("START event not sent: not tried" in m for m in refused), refused
        sent = b"".join(backend.requests)
        assert str(uuid.UUID(job["id"])).encode() in sent
        assert str(uuid.UUID(second["id"])).encode() not in sent
