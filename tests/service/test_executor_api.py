"""GET /v1/executor: the embedded executor's worker thread and queue while a real merge runs and
another waits; the celery executor's queue lengths read from a real (private) Redis, and its
broker reported unreachable once Redis stops; with auth on, the operator token's alone."""

from __future__ import annotations

import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from core.db.models import Job, utcnow
from service.api.monitor import running_job
from service.auth import create_key
from tests.distributed.conftest import RedisServer
from tests.helpers import wait_for
from tests.service.conftest import Service, layer_swap, running_service

OPERATOR_TOKEN = "op-" + "5" * 40


def health(service: Service, **headers: str) -> dict[str, Any]:
    response = service.client.get("/v1/executor", headers=headers)
    assert response.status_code == 200, response.text
    return dict(response.json())


def test_the_embedded_executor_shows_its_worker_its_queue_and_the_running_job(
    tmp_path: Path, examples: Path, gate: threading.Event
) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples) as s:
        idle = health(s)
        assert idle["executor"] == "local" and idle["queues"] == {"local": 0}
        assert idle["workers"] == [{"name": "layerswap-jobs", "alive": True, "job_id": None}]
        assert idle["running"] == [] and idle["queued"] == 0
        first = s.submit({**layer_swap(), "output": {"name": "first"}})["id"]
        second = s.submit({**layer_swap(), "output": {"name": "second"}})["id"]

        def busy() -> dict[str, Any] | None:
            seen = health(s)
            return seen if seen["workers"][0]["job_id"] == first and seen["running"] else None

        seen = wait_for(busy, "the first merge to run", 60, interval=0.05)
        assert seen["queues"] == {"local": 1} and seen["queued"] == 1  # the second waits
        [running] = seen["running"]
        assert running["id"] == first and running["kind"] == "merge" and running["alive"]
        assert running["heartbeat_at"] and 0 <= running["silent_s"] < seen["stale_after_s"]
        gate.set()
        for job_id in (first, second):
            assert s.wait(job_id)["status"] == "succeeded"
        done = health(s)
        assert done["running"] == [] and done["queues"] == {"local": 0} and done["queued"] == 0
        assert done["workers"][0]["alive"] and done["workers"][0]["job_id"] is None


def test_a_silent_running_job_is_shown_as_not_alive() -> None:
    now = utcnow()
    job = Job(id="j1", kind="merge", tenant_id="t", status="running", stage="merging",
              attempts=1, heartbeat_at=now - timedelta(seconds=45))  # fmt: skip
    shown = running_job(job, now, stale_after_s=30.0)
    assert shown["silent_s"] == 45.0 and not shown["alive"]
    assert running_job(job, now, stale_after_s=60.0)["alive"]


def test_the_celery_executor_reads_its_queue_lengths_from_redis(
    tmp_path: Path, examples: Path
) -> None:
    redis = RedisServer(tmp_path / "redis")
    redis.start()
    try:
        url = f"sqlite:///{tmp_path / 'layerswap.db'}"
        with running_service(
            tmp_path, url, examples, executor="celery", broker_url=redis.url
        ) as s:  # no worker: what is sent stays in Redis
            empty = health(s)
            assert empty["executor"] == "celery" and empty["broker"] == "ok"
            assert empty["queues"] == {"merge": 0, "eval": 0} and empty["workers"] is None
            for name in ("a", "b"):
                s.submit({**layer_swap(), "output": {"name": name}})

            def sent() -> dict[str, Any] | None:
                seen = health(s)
                # both in Redis and both marked sent (the mark follows the publish)
                done = seen["queues"] == {"merge": 2, "eval": 0} and seen["unsent"] == 0
                return seen if done else None

            seen = wait_for(sent, "two messages in the merge queue, marked sent", 30, interval=0.05)
            assert seen["queued"] == 2 and seen["unsent"] == 0 and seen["running"] == []
            assert redis.client().llen("merge") == 2  # what Redis itself holds
            redis.stop()
            down = health(s)
            assert down["broker"] == "unreachable" and down["queues"] is None
    finally:
        redis.stop()


def test_only_the_operator_token_reads_it_with_auth_on(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True, metrics_token=OPERATOR_TOKEN) as s:
        key = create_key(s.db, "team-a")
        assert s.client.get("/v1/executor").status_code == 401
        refused = s.client.get("/v1/executor", headers={"Authorization": f"Bearer {key}"})
        assert refused.status_code == 403, refused.text
        shown = health(s, Authorization=f"Bearer {OPERATOR_TOKEN}")
        assert shown["executor"] == "local" and shown["workers"][0]["alive"]
