"""Recovery without a broker in the way: stale heartbeats, lost deliveries, fenced attempts and
adopted outputs. On real SQLite and PostgreSQL; the pipeline and the engine run for real."""

from __future__ import annotations

import os
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

from core import jobs
from core.db.models import Job, as_utc, utcnow
from core.db.session import Database
from core.settings import Settings
from engine.io.digests import file_sha256
from engine.progress import Progress
from service.reconciler import Reconciler, requeue_stale
from tests.helpers import wait_for
from tests.service.test_store import (
    TENANT,
    copy_examples,
    event_types,
    job_row,
    new_job,
    set_state,
)
from worker.lease import JobLease
from worker.pipeline import _finish, run_job


class RecordingExecutor:
    """Remembers deliveries; `held` is what it still holds (what pending() reports)."""

    def __init__(self) -> None:
        self.dispatched: list[str] = []
        self.held: set[str] = set()
        self.reachable = True

    def dispatch(self, job_id: str, kind: str) -> None:
        self.dispatched.append(job_id)

    def pending(self) -> set[str]:
        if not self.reachable:
            raise ConnectionError("broker down")
        return set(self.held)

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


def silent_for(db: Database, job_id: str, seconds: float) -> None:
    set_state(db, job_id, heartbeat_at=utcnow() - timedelta(seconds=seconds))


def age(db: Database, job_id: str, seconds: float) -> None:
    set_state(db, job_id, created_at=utcnow() - timedelta(seconds=seconds))


def test_stale_running_jobs_are_requeued_failed_or_canceled(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    alive, dead, exhausted, canceling = (new_job(db, settings) for _ in range(4))
    for job_id in (alive, dead, exhausted, canceling):
        assert jobs.claim(db, job_id) == 1
    for job_id in (dead, exhausted, canceling):
        silent_for(db, job_id, settings.stale_after_s + 5)
    set_state(db, exhausted, attempts=settings.max_attempts)
    jobs.request_cancel(db, tenant=TENANT, job_id=canceling)

    executor = RecordingExecutor()
    done = Reconciler(db, settings, executor).run_once()

    assert done.requeued == [dead] and executor.dispatched == [dead]
    assert job_row(db, alive).status == jobs.RUNNING
    assert (job_row(db, dead).status, job_row(db, dead).attempts) == (jobs.QUEUED, 1)
    assert event_types(db, dead)[-1] == jobs.QUEUED
    failed = job_row(db, exhausted)
    assert failed.status == jobs.FAILED
    assert failed.error is not None and failed.error["code"] == "attempts_exhausted"
    assert "no heartbeat" in failed.error["message"]
    assert job_row(db, canceling).status == jobs.CANCELED

    # The next round finds nothing more to do.
    executor.held = {dead}
    again = Reconciler(db, settings, executor).run_once()
    assert again.requeued == [] and again.redispatched == []


def test_concurrent_reconcilers_requeue_a_job_once(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    job_id = new_job(db, settings)
    jobs.claim(db, job_id)
    silent_for(db, job_id, settings.stale_after_s + 5)
    results: list[list[tuple[str, str]]] = []
    barrier = threading.Barrier(4)

    def reconcile() -> None:
        barrier.wait(timeout=30)
        results.append(requeue_stale(db, settings.stale_after_s))

    threads = [threading.Thread(target=reconcile) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert sorted(len(r) for r in results) == [0, 0, 0, 1]
    assert event_types(db, job_id).count(jobs.QUEUED) == 2  # submitted, then re-queued once


def test_lost_deliveries_are_sent_again_and_held_ones_are_not(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    lost, held, _fresh = (new_job(db, settings) for _ in range(3))
    for job_id in (lost, held):
        age(db, job_id, 60)
    executor = RecordingExecutor()
    executor.held = {held}

    executor.reachable = False  # cannot tell what is lost: send nothing
    assert Reconciler(db, settings, executor).run_once().executor_unreachable
    assert executor.dispatched == []

    executor.reachable = True
    done = Reconciler(db, settings, executor).run_once()
    # `fresh` may still have its first message in flight; it is looked at next round.
    assert done.redispatched == [lost] and executor.dispatched == [lost]
    assert "redispatched" in event_types(db, lost)
    assert "redispatched" not in event_types(db, held)


def test_a_superseded_attempt_can_write_nothing(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1
    stale = JobLease(db, job_id, 1, settings)
    silent_for(db, job_id, settings.stale_after_s + 5)
    requeue_stale(db, settings.stale_after_s)
    assert jobs.claim(db, job_id) == 2  # another worker took it

    stale.progress(Progress("merging", 5, 10, 1, 2, 0.1))
    _finish(db, stale, jobs.FAILED, settings, error={"code": "x", "message": "late"})
    row = job_row(db, job_id)
    assert (row.status, row.attempts, row.bytes_done, row.error) == (jobs.RUNNING, 2, 0, None)
    assert jobs.FAILED not in event_types(db, job_id)

    with stale:  # its heartbeat finds the job gone and says so
        wait_for(lambda: stale.lost, "the stale lease to find its job gone", 10)
    assert stale.lost and stale.should_cancel()


def published_by_lost_attempt(db: Database, settings: Settings, examples: Path) -> Any:
    """A job whose attempt 1 published its output, then went silent and was re-queued:
    (job id, output directory, the engine's MergeResult)."""
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe

    copy_examples(settings, examples)
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1
    job = job_row(db, job_id)
    out_dir = jobs.output_dir(settings, job)
    checkpoints = settings.source_roots[0]
    result = merge(
        parse_recipe(job.request),
        out_dir,
        resolve=lambda s: checkpoints / s,
        options=MergeOptions(job={"id": job_id, "attempt": 1}, staging_tag=f"{job_id}-a1"),
    )
    silent_for(db, job_id, settings.stale_after_s + 5)
    requeue_stale(db, settings.stale_after_s)
    return job_id, out_dir, result


def test_an_output_published_by_a_lost_attempt_is_adopted(
    store: tuple[Database, Settings],
    examples: Path,
) -> None:
    """Attempt 1 published its output and died before recording it: attempt 2 records that
    output as it is (verified by sha256) instead of merging again."""
    db, settings = store
    job_id, out_dir, _ = published_by_lost_attempt(db, settings, examples)
    written = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}

    run_job(job_id, db=db, settings=settings)

    row = job_row(db, job_id)
    assert row.status == jobs.SUCCEEDED, row.error
    assert row.attempts == 2 and row.output_artifact_id is not None
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == written  # untouched
    assert sorted(p.name for p in out_dir.parent.iterdir()) == [out_dir.name]


def test_an_output_tampered_with_is_merged_again(
    store: tuple[Database, Settings],
    examples: Path,
) -> None:
    db, settings = store
    job_id, out_dir, result = published_by_lost_attempt(db, settings, examples)
    shard = next(out_dir.glob("*.safetensors"))
    with shard.open("r+b") as f:  # one flipped byte in the last tensor's data
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))

    run_job(job_id, db=db, settings=settings)

    row = job_row(db, job_id)
    assert row.status == jobs.SUCCEEDED and row.attempts == 2
    assert file_sha256(shard) == result.files[shard.name]  # rewritten, correct again


def test_another_jobs_output_is_never_replaced(
    store: tuple[Database, Settings],
    examples: Path,
) -> None:
    """Two jobs raced to the same output name: the second fails, even on a retry, and the
    first one's files stay as they were."""
    db, settings = store
    copy_examples(settings, examples)
    first = new_job(db, settings, top=1)
    taken = job_row(db, first).output_name
    second_job, _ = jobs.submit(
        db, settings, jobs.NewJob(TENANT, "merge", _other_recipe(job_row(db, first)), taken, None)
    )
    run_job(first, db=db, settings=settings)
    out_dir = jobs.output_dir(settings, job_row(db, first))
    before = {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()}
    set_state(db, second_job.id, attempts=1)  # as if a first attempt had been lost

    run_job(second_job.id, db=db, settings=settings)

    failed = job_row(db, second_job.id)
    assert failed.status == jobs.FAILED
    assert failed.error is not None and failed.error["code"] == "output_error"
    assert {p.name: p.stat().st_mtime_ns for p in out_dir.iterdir()} == before


def _other_recipe(job: Job) -> dict[str, Any]:
    request = dict(job.request)
    request["params"] = {**request["params"], "top": 2}
    return request


def test_heartbeats_come_from_their_own_thread(
    store: tuple[Database, Settings],
) -> None:
    """No progress at all (a long fsync, a huge tensor), yet the job stays alive."""
    db, settings = store
    job_id = new_job(db, settings)
    jobs.claim(db, job_id)
    silent_for(db, job_id, 3600)
    with JobLease(db, job_id, 1, settings):

        def beaten() -> bool:
            beat = as_utc(job_row(db, job_id).heartbeat_at)
            return beat is not None and (utcnow() - beat).total_seconds() < 60

        wait_for(beaten, "a heartbeat from the lease's thread", 10, interval=0.05)
    assert requeue_stale(db, settings.stale_after_s) == []
