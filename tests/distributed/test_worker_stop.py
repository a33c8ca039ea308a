"""A stop in the middle of a job (SIGTERM to `layerswap worker`, the API process's own executor
shut down): the job stops at its next check, leaves no partial output and goes back to the
queue at once, and the next worker runs it to the same output, once."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core import jobs
from core.db.models import Job, JobEvent
from tests.distributed.conftest import Cluster, leftovers, outputs, ties, wait_for
from tests.distributed.test_celery import (  # noqa: F401  (ties_reference: a fixture)
    assert_output_matches,
    finished,
    mid_merge,
    ties_reference,
)
from tests.service.conftest import running_service

pytestmark = pytest.mark.timeout(300)
HANDED_BACK = "re-queued: its worker stopped"


def queued_events(cluster: Cluster, job_id: str) -> list[dict[str, Any]]:
    events = cluster.service.client.get(f"/v1/merges/{job_id}/events").json()
    return [e for e in events if e["type"] == "queued"]


def test_a_worker_stopped_mid_merge_hands_its_job_back_and_exits(
    cluster: Cluster,
    big_family: Path,
    ties_reference: dict[str, str],  # noqa: F811  (the fixture imported above)
) -> None:
    worker = cluster.start_worker()
    job = cluster.service.submit(ties(big_family, name="handed-back"))
    cluster.wait_until(job["id"], mid_merge())

    worker.process.send_signal(signal.SIGTERM)
    wait_for(lambda: worker.process.poll() is not None, "the worker to exit", timeout=60)
    code = worker.process.returncode
    assert code == 0, worker.text()  # Celery's warm shutdown, ended
    stopped = cluster.job(job["id"])  # not finished first: handed back
    assert (stopped["status"], stopped["attempts"]) == ("queued", 1), stopped
    assert [e["data"].get("reason") for e in queued_events(cluster, job["id"])][-1] == HANDED_BACK
    assert outputs(cluster.service) == [] and leftovers(cluster.service) == []
    waiting = [json.loads(m) for m in cluster.redis.client().lrange("merge", 0, -1)]
    assert [m["headers"]["id"].split(".")[0] for m in waiting] == [job["id"]], "message back"

    cluster.start_worker()
    done = cluster.wait_until(job["id"], finished)
    assert (done["status"], done["attempts"]) == ("succeeded", 2), done
    assert cluster.event_types(job["id"]).count("succeeded") == 1
    assert_output_matches(cluster, done, ties_reference)
    assert outputs(cluster.service) == ["handed-back"] and leftovers(cluster.service) == []
    with cluster.service.db.session() as session:
        row = session.get(Job, job["id"])
        assert row is not None and row.max_attempts == 3 + 1, "a stop uses up no attempt"


def test_an_api_process_stopping_hands_its_running_job_back(
    tmp_path: Path, examples: Path, big_family: Path
) -> None:
    """The embedded default: the job runs on a thread of the API process, whose shutdown
    (uvicorn's, on SIGTERM) stops it and leaves it queued for the next start."""
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    data = tmp_path / "data"
    roots = [data / "checkpoints", data / "artifacts", big_family]
    with running_service(tmp_path, url, examples, allowed_roots=roots) as service:
        job = service.submit(ties(big_family, name="handed-back"))

        def merging() -> dict[str, Any] | None:
            seen = dict(service.client.get(f"/v1/merges/{job['id']}").json())
            return seen if mid_merge()(seen) else None

        wait_for(merging, "the merge to be under way")
    with service.db.session() as session:
        row = session.get(Job, job["id"])
        assert row is not None
        assert (row.status, row.attempts, row.stage) == (jobs.QUEUED, 1, None)
        events = session.scalars(
            select(JobEvent).where(JobEvent.job_id == job["id"]).order_by(JobEvent.id)
        )
        reasons = [e.data.get("reason") for e in events if e.type == jobs.QUEUED]
    assert reasons[-1] == HANDED_BACK
    assert outputs(service) == [] and leftovers(service) == []
