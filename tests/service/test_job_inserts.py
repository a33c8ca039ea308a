"""Group commit of submitted jobs on real PostgreSQL (core/job_inserts.py): jobs that arrive
while a batch is out go in together, and a failing job in a batch fails only its own submit."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from sqlalchemy import event, func, select, text

from core import job_inserts, jobs
from core.db.models import Job, JobEvent
from core.db.session import Database
from core.settings import Settings
from tests.helpers import wait_for
from tests.service.conftest import TENANT, layer_swap


def test_jobs_arriving_during_a_write_go_in_one_batch_and_a_failing_one_fails_alone(
    pg_store: tuple[Database, Settings],
) -> None:
    db, settings = pg_store
    batches: list[int] = []  # rows per executemany of the writer's statement

    def seen(_conn: Any, _cursor: Any, statement: str, params: Any, _ctx: Any, many: bool) -> None:
        if many and "INSERT INTO job_events" in statement:
            batches.append(len(params))

    event.listen(db.engine, "before_cursor_execute", seen)
    writer = job_inserts.writer_for(db)

    def submit(key: str | None, **params: Any) -> Future[tuple[Job, bool]]:
        new = jobs.NewJob(TENANT, "merge", layer_swap(**params), None, key)
        return pool.submit(jobs.submit, db, settings, new)

    with ThreadPoolExecutor(4) as pool, db.engine.connect() as holder:
        holder.execute(text("LOCK TABLE jobs IN SHARE MODE"))  # INSERTs wait for it
        first = submit(None)  # leads: its lone insert waits on the lock
        wait_for(lambda: holder.scalar(text(
            "SELECT count(*) FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "WHERE c.relname = 'jobs' AND NOT l.granted")) == 1, "the first insert to wait", 30,
            interval=0.01,
        )  # fmt: skip
        retry_a, retry_b = submit("same-key"), submit("same-key")  # the same request twice
        other = submit("other-key", bottom=2)
        queued = "three jobs to queue behind the first"
        wait_for(lambda: writer.waiting() == 3, queued, 30, interval=0.01)
        holder.commit()  # lets the first insert through
        results = [f.result(timeout=30) for f in (first, retry_a, retry_b, other)]

    assert batches[0] == 3  # the three that waited were tried in one transaction
    (job, created), (a, a_created), (b, b_created), (o, o_created) = results
    assert created and o_created
    assert a.id == b.id and [a_created, b_created].count(True) == 1  # the key's race: one job
    with db.session() as session:
        ids = set(session.scalars(select(Job.id)))
        assert ids == {job.id, a.id, o.id}
        events = session.execute(select(JobEvent.job_id, JobEvent.type)).all()
        assert sorted(events) == sorted((i, jobs.QUEUED) for i in ids)
        assert session.scalar(select(func.count()).select_from(JobEvent)) == 3


def test_many_concurrent_submits_are_each_written_once(pg_store: tuple[Database, Settings]) -> None:
    db, settings = pg_store
    start = threading.Barrier(16)

    def submit(i: int) -> str:
        start.wait(timeout=30)
        job, created = jobs.submit(
            db, settings, jobs.NewJob(TENANT, "merge", layer_swap(bottom=1 + i % 2), None, None)
        )
        assert created
        return job.id

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(submit, range(16), timeout=60))
    assert len(set(ids)) == 16
    assert job_inserts.writer_for(db).waiting() == 0
    with db.session() as session:
        rows = session.execute(select(JobEvent.job_id, JobEvent.type)).all()
    assert sorted(rows) == sorted((i, jobs.QUEUED) for i in ids)
