"""Jobs on Celery workers over a real Redis, with PostgreSQL as the truth: progress, cancel,
the message format, and every fault: SIGKILLed workers, Redis losing its queue, duplicate
deliveries racing, a database restart in the final write, and a worker cut off from the
database."""

from __future__ import annotations

import base64
import json
import os
import random
import re
import signal
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select, text
from sqlalchemy.pool import NullPool

from core import jobs
from core.db.models import Job
from engine.io.digests import file_sha256
from tests.distributed.conftest import (
    HUB_TOKEN,
    LAYERSWAP,
    Cluster,
    leftovers,
    outputs,
    ties,
    wait_for,
)
from tests.service.conftest import layer_swap
from tests.service.test_api_lifecycle import metric
from tests.service.test_database_down import TcpProxy

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="session")
def ties_reference(big_family: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """sha256 of every weight file of the TIES merge, made once in this process by the engine
    (itself checked against an independent reference in tests/engine)."""
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe

    out = tmp_path_factory.mktemp("ties-reference") / "out"
    recipe = parse_recipe(ties(big_family))
    result = merge(recipe, out, resolve=Path, options=MergeOptions(durable=False))
    return {name: sha for name, sha in result.files.items() if name.endswith(".safetensors")}


def assert_output_matches(cluster: Cluster, job: dict[str, Any], reference: dict[str, str]) -> None:
    out_dir = cluster.service.settings.artifacts_dir / "default" / job["request"]["output"]["name"]
    weights = sorted(p.name for p in out_dir.glob("*.safetensors"))
    assert weights == sorted(reference)
    for name, sha in reference.items():
        assert file_sha256(out_dir / name) == sha, name


def mid_merge(fraction: float = 0.0, before: float = 0.5) -> Any:
    """Running, with at least `fraction` and less than `before` of the bytes written, so
    whatever the test does next happens while the merge still has seconds to go."""

    def check(job: dict[str, Any]) -> bool:
        assert job["status"] in ("queued", "running"), job
        progress = job.get("progress") or {}
        done, total = progress.get("bytes_done") or 0, progress.get("bytes_total") or 0
        return (
            job["status"] == "running" and total > 0 and fraction * total <= done < before * total
        )

    return check


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "canceled")


def mid_merge_or_finished(fraction: float) -> Any:
    """Running with at least `fraction` of the bytes written, or already finished: the last
    8 MB blocks of a merge can land between two polls."""
    running = mid_merge(fraction, before=1.0)
    return lambda job: finished(job) or running(job)


# --- the happy path and the message ------------------------------------------------------


def test_job_runs_on_a_worker_with_progress_visible(
    cluster: Cluster, big_family: Path, ties_reference: dict[str, str]
) -> None:
    worker = cluster.start_worker()
    job = cluster.service.submit(ties(big_family, name="merged"))
    assert job["status"] == "queued"

    seen = cluster.wait_until(job["id"], mid_merge(fraction=0.01))  # bytes on disk, shown
    assert 0 < seen["progress"]["bytes_done"] < seen["progress"]["bytes_total"]
    assert seen["attempts"] == 1

    done = cluster.wait_until(job["id"], finished)
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1
    assert_output_matches(cluster, done, ties_reference)
    assert f"job {job['id']}: attempt 1 started" in worker.text()
    assert outputs(cluster.service) == ["merged"] and leftovers(cluster.service) == []


def test_the_message_carries_only_the_job_id(cluster: Cluster, big_family: Path) -> None:
    job = cluster.service.submit(ties(big_family, name="private-name"))
    redis = cluster.redis.client()
    raw = wait_for(lambda: redis.lrange("merge", 0, -1), "the message in Redis")
    assert len(raw) == 1
    message = json.loads(raw[0])
    args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert (args, kwargs) == ([job["id"]], {})
    assert message["headers"]["task"] == "layerswap.run_job"
    for secret in (str(big_family), "private-name", "density", "models"):
        assert secret not in raw[0].decode(), secret


def test_waiting_messages_go_out_together_one_per_job_and_run(cluster: Cluster) -> None:
    """The publisher sends whatever has piled up in one Redis pipeline: here 40 jobs handed to
    an executor before its publishing thread starts. Each job gets exactly one message, in the
    format the worker reads (they all run), and no `task-sent` event is published for them."""
    from worker.executors import CeleryExecutor

    settings, db = cluster.service.settings, cluster.service.db
    jobs.ensure_tenant(db, "default")
    made = [
        jobs.submit(db, settings, jobs.NewJob("default", "merge", layer_swap(), None, None))[0].id
        for _ in range(40)
    ]
    redis = cluster.redis.client()
    redis.config_resetstat()
    executor = CeleryExecutor(settings)
    for job_id in made:
        executor.dispatch(job_id, "merge")
    executor.start()
    wait_for(lambda: redis.llen("merge") >= 40, "40 messages in Redis")
    executor.stop()

    # The API's reconciler sends a job again only if its message is not in Redis a second
    # after the job was made (possible on a slow machine): it sends the message, then records
    # "redispatched" in the job's events. Each message beyond the 40 is such a one, once the
    # reconciler has recorded them.
    def sent_again() -> tuple[list[str]] | None:
        again = [j for j in made for t in cluster.event_types(j) if t == "redispatched"]
        calls = redis.info("commandstats")["cmdstat_lpush"]["calls"]
        return (again,) if calls == 40 + len(again) else None

    (again,) = wait_for(sent_again, "one message per job, and one per re-dispatch recorded")
    assert "cmdstat_publish" not in redis.info("commandstats"), "no event fanout per message"
    messages = [json.loads(raw) for raw in redis.lrange("merge", 0, -1)]
    assert sorted(m["headers"]["id"].split(".")[0] for m in messages) == sorted(made + again)
    cluster.start_worker()
    for job_id in made:
        assert cluster.wait_until(job_id, finished)["status"] == "succeeded"
        assert cluster.event_types(job_id).count("running") == 1


def test_a_worker_can_run_at_a_lower_cpu_priority(cluster: Cluster) -> None:
    """`layerswap worker --nice 7`: the worker process (all its threads) runs 7 nice levels
    below whoever started it, and runs jobs as any other."""
    log = cluster.logs / "nice.log"
    with log.open("ab") as out:
        process = subprocess.Popen(
            [str(LAYERSWAP), "worker", "--nice", "7", "--hostname", "nice@test"],
            env=cluster.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: " ready." in log.read_text(errors="replace"), "the worker to start")
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        for thread in Path(f"/proc/{process.pid}/task").iterdir():
            assert os.getpriority(os.PRIO_PROCESS, int(thread.name)) == min(mine + 7, 19)
        job = cluster.service.submit(layer_swap())
        assert cluster.wait_until(job["id"], finished)["status"] == "succeeded"
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=20)


def test_analysis_jobs_run_on_workers_too(cluster: Cluster) -> None:
    cluster.start_worker()
    body = {"base": "base", "experts": [{"label": "math", "path": "math"}]}
    response = cluster.service.client.post("/v1/analyses", json=body)
    assert response.status_code == 202, response.text
    done = cluster.service.wait(response.json()["id"], kind="analyses")
    assert done["status"] == "succeeded", done["error"]


# --- cancellation ------------------------------------------------------------------------


def test_cancel_reaches_a_running_job_on_a_worker(cluster: Cluster, big_family: Path) -> None:
    worker = cluster.start_worker()
    job = cluster.service.submit(ties(big_family, name="never"))
    cluster.wait_until(job["id"], mid_merge())
    asked = time.monotonic()
    response = cluster.service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "canceling"

    done = cluster.wait_until(job["id"], finished)
    assert done["status"] == "canceled"
    assert time.monotonic() - asked < 10, "the worker saw the cancel within seconds"
    assert outputs(cluster.service) == [] and leftovers(cluster.service) == []

    # The worker is free again and still serves.
    follow = cluster.service.submit(layer_swap())
    assert cluster.wait_until(follow["id"], finished)["status"] == "succeeded"
    assert worker.process.poll() is None


# --- SIGKILL, repeatedly -------------------------------------------------------------------


def test_sigkilled_workers_leave_every_job_succeeded_exactly_once(
    cluster: Cluster, big_family: Path, ties_reference: dict[str, str]
) -> None:
    """Kill the worker at a random point of the merge (5 times, more if a kill came too late),
    start a fresh one; every job must end succeeded once, with one complete output."""
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    worker = cluster.start_worker()
    interrupted: list[str] = []
    submitted: list[str] = []
    while len(interrupted) < 5:
        assert len(submitted) < 20, f"kills kept missing the merges (seed {seed})"
        job = cluster.service.submit(ties(big_family, name=f"kill-{len(submitted)}"))
        submitted.append(job["id"])
        seen = cluster.wait_until(job["id"], mid_merge_or_finished(rng.uniform(0.0, 0.9)))
        if not finished(seen):  # else its last writes outran the polls: this kill is missed
            time.sleep(rng.uniform(0.0, 0.3))  # the kill's timing is random, not tied to a write
            worker.kill()
            worker = cluster.start_worker()
        done = cluster.wait_until(job["id"], finished)
        assert done["status"] == "succeeded", (seed, done)
        if done["attempts"] >= 2:
            interrupted.append(job["id"])

    for job_id in submitted:
        done = cluster.job(job_id)
        assert done["status"] == "succeeded", (seed, done)
        types = cluster.event_types(job_id)
        assert types.count("succeeded") == 1, (seed, types)
        assert types.count("running") == done["attempts"], (seed, types)
        assert_output_matches(cluster, done, ties_reference)
    assert outputs(cluster.service) == sorted(f"kill-{i}" for i in range(len(submitted)))
    assert leftovers(cluster.service) == [], seed
    retries = metric(cluster.service.client.get("/metrics").text, "layerswap_job_retries_total")
    assert retries is not None and retries >= len(interrupted)
    with cluster.service.db.session() as session:
        artifacts = session.scalars(select(Job.output_artifact_id).where(Job.id.in_(submitted)))
        assert len(set(artifacts)) == len(submitted)


# --- Redis loses its queue -----------------------------------------------------------------


def test_redis_restart_loses_no_queued_job_and_runs_none_twice(
    cluster: Cluster, big_family: Path
) -> None:
    """A worker busy with a long merge; 24 jobs queued behind it; Redis stops (its queue is
    gone: no persistence), 4 more are submitted while it is down, then it comes back."""
    worker = cluster.start_worker()
    long = cluster.service.submit(ties(big_family, name="long"))
    cluster.wait_until(long["id"], mid_merge())
    queued = [cluster.service.submit(layer_swap(), **{"Idempotency-Key": f"q{i}"})["id"]
              for i in range(24)]  # fmt: skip
    redis = cluster.redis.client()
    wait_for(lambda: redis.llen("merge") == 24, "24 messages in Redis")

    assert cluster.service.client.get("/readyz").json() == {"status": "ready", "broker": "ok"}
    cluster.redis.stop()
    ready = cluster.service.client.get("/readyz")  # still ready: submits are accepted
    assert ready.status_code == 200 and ready.json()["broker"] == "unreachable"
    for i in range(4):  # accepted while the broker is down: the row is the truth
        queued.append(
            cluster.service.submit(layer_swap(top=2), **{"Idempotency-Key": f"d{i}"})["id"]
        )
    cluster.redis.start()

    for job_id in [long["id"], *queued]:
        done = cluster.wait_until(job_id, finished)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 1, done
        types = cluster.event_types(job_id)
        assert types.count("running") == 1 and types.count("succeeded") == 1, types
    redispatched = [j for j in queued if "redispatched" in cluster.event_types(j)]
    assert len(redispatched) >= 24, "the lost messages were sent again by the reconciler"
    metrics = cluster.service.client.get("/metrics").text
    assert metric(metrics, "layerswap_redispatches_total") >= len(redispatched)
    assert metric(metrics, "layerswap_oldest_queued_seconds") == 0
    assert len(outputs(cluster.service)) == 29 and leftovers(cluster.service) == []
    assert worker.process.poll() is None, "the worker rode out the outage"


def test_a_job_ending_while_redis_is_down_leaves_its_worker_taking_jobs(
    cluster: Cluster, big_family: Path
) -> None:
    """The job's ack fails (Redis is down as it ends), which leaves kombu's consumer waiting on
    no socket at all; the watchdog (worker/watchdog.py) reconnects it once jobs wait."""
    worker = cluster.start_worker()
    long = cluster.service.submit(ties(big_family, name="long"))
    cluster.wait_until(long["id"], mid_merge())
    cluster.redis.stop()
    assert cluster.wait_until(long["id"], finished)["status"] == "succeeded"
    wait_for(lambda: "Couldn't ack" in worker.text(), "the ack to fail with Redis down")
    cluster.redis.start()

    after = cluster.service.submit(layer_swap())
    done = cluster.wait_until(after["id"], finished)
    assert done["status"] == "succeeded" and done["attempts"] == 1, done
    assert "reconnecting to the broker" in worker.text(), "the watchdog found the wedge"
    assert worker.process.poll() is None


# --- duplicate deliveries --------------------------------------------------------------------


def test_two_workers_racing_for_one_job_claim_it_once(cluster: Cluster) -> None:
    """The same job delivered twice at once (a redelivery) to two idle workers."""
    first, second = cluster.start_worker(), cluster.start_worker()
    settings, db = cluster.service.settings, cluster.service.db
    jobs.ensure_tenant(db, "default")
    job, _ = jobs.submit(db, settings, jobs.NewJob("default", "merge", layer_swap(), None, None))
    executor: Any = cluster.service.client.app.state.context.executor  # type: ignore[attr-defined]
    for nonce in ("a", "b"):
        executor.app.send_task(
            "layerswap.run_job", args=[job.id], queue="merge", task_id=f"{job.id}.{nonce}"
        )

    logs = lambda: first.text() + second.text()  # noqa: E731
    wait_for(
        lambda: f"job {job.id}: not queued" in logs() and f"job {job.id}: attempt 1 done" in logs(),
        "both deliveries handled: one ran the job, the other found it taken",
    )
    done = cluster.wait_until(job.id, finished)
    assert done["status"] == "succeeded" and done["attempts"] == 1
    assert logs().count(f"job {job.id}: attempt 1 started") == 1
    assert logs().count(f"job {job.id}: not queued") == 1
    types = cluster.event_types(job.id)
    assert types.count("running") == 1 and types.count("succeeded") == 1
    assert cluster.redis.client().llen("merge") == 0


# --- the database goes away ------------------------------------------------------------------


@pytest.mark.own_postgres  # restarted: a server of its own, the machine's stays up for the rest
def test_database_restart_during_the_final_write(
    cluster: Cluster, big_family: Path, ties_reference: dict[str, str]
) -> None:
    """PostgreSQL restarts while the worker is inside the job's final write (the one that
    records the output and marks the job succeeded): that write fails and is retried across
    the restart, and the job ends succeeded by its first attempt, once.

    The moment is forced, not hoped for: the test holds a lock on the artifacts table, so the
    worker's final transaction waits at its INSERT INTO artifacts, which the test sees in
    pg_stat_activity; then it restarts PostgreSQL."""
    worker = cluster.start_worker()
    job = cluster.service.submit(ties(big_family, name="through-restart"))
    cluster.wait_until(job["id"], mid_merge())
    url = cluster.service.settings.database
    locker = create_engine(url, poolclass=NullPool)
    connection = locker.connect()
    connection.begin()
    connection.execute(text("LOCK TABLE artifacts IN EXCLUSIVE MODE"))

    def waiting_final_write() -> Any:
        with cluster.service.db.session() as session:
            return session.scalar(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND wait_event_type = 'Lock' AND query LIKE 'INSERT INTO artifacts%'"
                )
            )

    wait_for(waiting_final_write, "the worker's final write to wait on the lock", timeout=120)
    assert cluster.job(job["id"])["status"] == "running"  # not recorded yet: it is waiting
    retried_before = worker.text().count(f"job {job['id']}: database unavailable")
    with cluster.service.db.session() as session:
        started = session.scalar(text("SELECT pg_postmaster_start_time()"))
    assert cluster.postgres is not None
    cluster.postgres.restart()  # ends the test's lock and the worker's transaction with it
    connection.invalidate()
    locker.dispose()

    def settled() -> dict[str, Any] | None:
        response = cluster.service.client.get(f"/v1/merges/{job['id']}")
        if response.status_code == 503:
            return None  # the API's own connections are being re-made
        body = dict(response.json())
        return body if finished(body) else None

    done = wait_for(settled, "the job to settle after the restart", timeout=120)
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 1, "the first attempt's retried write recorded it"
    assert worker.text().count(f"job {job['id']}: database unavailable") > retried_before
    with cluster.service.db.session() as session:
        restarted = session.scalar(text("SELECT pg_postmaster_start_time()"))
    assert restarted is not None and restarted > started
    assert datetime.fromisoformat(done["finished_at"]) > restarted
    types = cluster.event_types(job["id"])
    assert types.count("running") == 1 and types.count("succeeded") == 1, types
    assert worker.process.poll() is None
    assert_output_matches(cluster, done, ties_reference)
    assert outputs(cluster.service) == ["through-restart"] and leftovers(cluster.service) == []


def test_a_worker_cut_off_from_the_database_is_superseded(
    cluster: Cluster, big_family: Path, ties_reference: dict[str, str]
) -> None:
    """Worker 1 reaches PostgreSQL through a proxy that is then cut: alive but silent, it is
    presumed dead; worker 2 takes attempt 2. When worker 1 is heard again, everything it tries
    to write is refused (fenced by attempt), and the output is still exactly one."""
    url = cluster.service.settings.database
    host_port = url.split("@", 1)[1].split("/", 1)[0]
    proxy = TcpProxy((host_port.split(":")[0], int(host_port.split(":")[1])))
    proxy.start()
    proxied = url.replace(host_port, f"127.0.0.1:{proxy.port}")
    try:
        cut_off = cluster.start_worker("cut-off", LAYERSWAP_DATABASE_URL=proxied)
        job = cluster.service.submit(ties(big_family, name="fenced"))
        cluster.wait_until(job["id"], mid_merge())
        proxy.stop()
        cluster.start_worker("rescuer")

        done = cluster.wait_until(job["id"], finished)
        assert done["status"] == "succeeded", done
        assert done["attempts"] == 2
        proxy.start()
        wait_for(
            lambda: "superseded" in cut_off.text() or "lease lost" in cut_off.text(),
            "the cut-off worker to give up its attempt",
        )
        assert cluster.job(job["id"])["attempts"] == 2
        assert cluster.job(job["id"])["status"] == "succeeded"
        types = cluster.event_types(job["id"])
        assert types.count("succeeded") == 1 and types.count("running") == 2, types
        assert_output_matches(cluster, done, ties_reference)
        assert outputs(cluster.service) == ["fenced"] and leftovers(cluster.service) == []
    finally:
        proxy.stop()


# --- Hub sources and destinations on workers ------------------------------------------------


def test_a_worker_killed_while_publishing_leaves_one_commit(
    cluster: Cluster, big_family: Path, hub: Any, tmp_path: Path
) -> None:
    """The worker dies mid-upload (the hub holds its first upload unanswered until the kill);
    the next attempt adopts the local output and publishes it, and the destination ends with
    exactly one commit of it. The token, configured on the workers by name, appears in no
    Redis command (MONITOR records every one, task bodies decoded), log, row or response."""
    hub.add_token(HUB_TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    held = hub.hold_upload()
    with cluster.redis.monitor(tmp_path / "redis-monitor.log") as redis_commands:
        worker = cluster.start_worker()
        body = ties(big_family, name="published")
        body["output"]["hub"] = {"repo": "team-a/published", "credential": "team-a"}
        job = cluster.service.submit(body)
        wait_for(held.reached.is_set, "the worker's first upload to reach the hub", timeout=120)
        assert cluster.job(job["id"])["stage"] == "publishing"
        worker.kill()
        held.release()
        rescuer = cluster.start_worker("rescuer")

        done = cluster.wait_until(job["id"], finished)
        traffic = redis_commands()
    assert done["status"] == "succeeded", done
    assert done["attempts"] == 2
    assert [r.fault for r in hub.requests].count("hold") == 1
    commits = hub.commits("team-a/published")
    assert len(commits) == 2, [c.title for c in commits]  # the initial one, and ours once
    out_dir = cluster.service.settings.artifacts_dir / "default" / "published"
    remote = hub.entries("team-a/published")
    for path in out_dir.iterdir():
        assert remote[path.name].sha256 == file_sha256(path), path.name
    assert "adopting the output" in rescuer.text()

    # Task messages are base64 inside the commands MONITOR shows: decode them too.
    bodies = re.findall(r'\\"body\\": \\"([A-Za-z0-9+/=]+)\\"', traffic)
    decoded = [base64.b64decode(b).decode() for b in bodies]
    assert any(job["id"] in message for message in decoded), "the task messages were recorded"
    with cluster.service.db.session() as session:
        rows = [
            str(row)
            for table in ("jobs", "job_events", "artifacts")
            for row in session.execute(text(f"SELECT * FROM {table}")).all()
        ]
    assert any(job["id"] in row for row in rows)
    for seen in (
        traffic,
        *decoded,
        *rows,
        worker.text(),
        rescuer.text(),
        cluster.service.client.get(f"/v1/merges/{job['id']}").text,
        cluster.service.client.get(f"/v1/merges/{job['id']}/events").text,
    ):
        assert HUB_TOKEN not in seen
