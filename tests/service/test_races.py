"""Compare-and-set where a read then a write would lose a race: a cancel against a job that
finishes, and an attempt's final write against the reconciler. On real SQLite and PostgreSQL,
with the interleaving forced, not hoped for: the other side's change is written first and
committed exactly when this side sends its write."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy import Connection, event, update

from core import jobs
from core.db.models import Job
from core.db.session import Database
from core.errors import Conflict
from core.settings import Settings
from tests.service.test_store import (
    TENANT,
    event_types,
    job_row,
    new_job,
)
from worker.lease import JobLease
from worker.pipeline import _finish


def commit_when_written(
    db: Database, first: Callable[[Connection], None], second: Callable[[], Any]
) -> Any:
    """Run `first` in an open transaction of its own; run `second` on `db` in a thread; commit
    `first` at the moment `second` sends its first write of the jobs table (an UPDATE, or a
    SELECT ... FOR UPDATE). Whatever `second` read before that saw the state before `first`;
    its write meets the state after. Returns what `second` returned or raised."""
    other = Database(db.url)
    written = threading.Event()
    outcome: dict[str, Any] = {}

    def seen(_c: Any, _cur: Any, statement: str, *_: Any) -> None:
        sql = " ".join(statement.split()).upper()
        if threading.current_thread() is thread and (
            sql.startswith("UPDATE JOBS") or "FOR UPDATE" in sql
        ):
            written.set()

    def run() -> None:
        try:
            outcome["value"] = second()
        except BaseException as e:  # handed to the test below
            outcome["error"] = e

    thread = threading.Thread(target=run)
    event.listen(db.engine, "before_cursor_execute", seen)
    try:
        with other.engine.connect() as connection, connection.begin():
            first(connection)
            thread.start()
            assert written.wait(30), "the second side never wrote"
        thread.join(60)
        assert not thread.is_alive()
    finally:
        event.remove(db.engine, "before_cursor_execute", seen)
        other.dispose()
    return outcome.get("error", outcome.get("value"))


def set_status(job_id: str, status: str) -> Callable[[Connection], None]:
    def write(connection: Connection) -> None:
        connection.execute(update(Job).where(Job.id == job_id).values(status=status))

    return write


@pytest.mark.parametrize("finished", [jobs.SUCCEEDED, jobs.FAILED])
def test_a_job_that_finishes_during_a_cancel_stays_finished(
    store: tuple[Database, Settings],
    finished: str,
) -> None:
    db, settings = store
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1

    result = commit_when_written(
        db,
        set_status(job_id, finished),
        lambda: jobs.request_cancel(db, tenant=TENANT, job_id=job_id),
    )

    assert isinstance(result, Conflict), result
    assert result.details == {"status": finished}
    row = job_row(db, job_id)
    assert row.status == finished and not row.cancel_requested
    assert jobs.CANCELING not in event_types(db, job_id)


def test_a_job_claimed_during_a_cancel_is_asked_to_stop(
    store: tuple[Database, Settings],
) -> None:
    """queued -> running between the two compare-and-sets: the cancel still lands, as
    canceling, with one event."""
    db, settings = store
    job_id = new_job(db, settings)

    result = commit_when_written(
        db,
        set_status(job_id, jobs.RUNNING),
        lambda: jobs.request_cancel(db, tenant=TENANT, job_id=job_id),
    )

    assert isinstance(result, Job) and result.status == jobs.CANCELING, result
    row = job_row(db, job_id)
    assert (row.status, row.cancel_requested) == (jobs.CANCELING, True)
    assert event_types(db, job_id) == [jobs.QUEUED, jobs.CANCELING]


@pytest.mark.parametrize("taken_to", [jobs.QUEUED, jobs.FAILED, jobs.CANCELED])
def test_a_final_write_loses_to_the_reconciler(
    store: tuple[Database, Settings],
    taken_to: str,
) -> None:
    """The reconciler re-queues (or gives up on) the job just as its attempt writes its end:
    the attempt's write changes nothing and writes no event."""
    db, settings = store
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1
    lease = JobLease(db, job_id, 1, settings)

    commit_when_written(
        db,
        set_status(job_id, taken_to),
        lambda: _finish(db, lease, jobs.SUCCEEDED, settings, result={"late": True}),
    )

    row = job_row(db, job_id)
    assert (row.status, row.result) == (taken_to, None)
    assert jobs.SUCCEEDED not in event_types(db, job_id)


def test_a_cancel_during_the_final_write_keeps_the_result(
    store: tuple[Database, Settings],
) -> None:
    """running -> canceling while the attempt finishes: canceling still belongs to the attempt,
    so its end is written (the work was done) and the cancel comes too late."""
    db, settings = store
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1
    lease = JobLease(db, job_id, 1, settings)

    commit_when_written(
        db,
        set_status(job_id, jobs.CANCELING),
        lambda: _finish(db, lease, jobs.SUCCEEDED, settings, result={"done": True}),
    )

    row = job_row(db, job_id)
    assert (row.status, row.result) == (jobs.SUCCEEDED, {"done": True})
    assert event_types(db, job_id).count(jobs.SUCCEEDED) == 1
