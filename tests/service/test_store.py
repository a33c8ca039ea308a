"""The store itself: migrations are the schema, claims are compare-and-set, redelivered jobs run
once, interrupted jobs are requeued. On real SQLite and PostgreSQL, no app in between."""

from __future__ import annotations

import shutil
import threading
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from fastapi.testclient import TestClient
from sqlalchemy import Index, MetaData, create_engine, func, inspect, select, update
from sqlalchemy.exc import DBAPIError, IntegrityError

from core import jobs
from core.db.migrate import upgrade
from core.db.models import Artifact, Base, Job, JobEvent, LineageEdge, as_utc, utcnow
from core.db.session import Database
from core.settings import Settings
from layerswap.app import build_app
from tests.service.conftest import TENANT, layer_swap, make_settings
from worker.pipeline import run_job


def new_job(db: Database, settings: Settings, **params: Any) -> str:
    job, created = jobs.submit(
        db, settings, jobs.NewJob(TENANT, "merge", layer_swap(**params), None, None)
    )
    assert created
    return job.id


def job_row(db: Database, job_id: str) -> Job:
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        return job


def event_types(db: Database, job_id: str) -> list[str]:
    with db.session() as session:
        return list(
            session.scalars(
                select(JobEvent.type).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
            )
        )


def set_state(db: Database, job_id: str, **values: Any) -> None:
    with db.session() as session:
        session.execute(update(Job).where(Job.id == job_id).values(**values))


# --- models and migrations ---------------------------------------------------------------


def schema_diff(url: str, metadata: MetaData) -> list[Any]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def test_migrations_build_exactly_the_models(database_url: str) -> None:
    upgrade(database_url)
    assert schema_diff(database_url, Base.metadata) == []

    # The comparison is not blind: one index the migrations lack is reported.
    drifted = MetaData()
    for table in Base.metadata.sorted_tables:
        table.to_metadata(drifted)
    Index("ix_jobs_stage", drifted.tables["jobs"].c.stage)
    diff = schema_diff(database_url, drifted)
    assert [d[0] for d in diff] == ["add_index"], diff
    assert diff[0][1].name == "ix_jobs_stage"


def test_the_app_never_creates_the_schema(tmp_path: Path, database_url: str) -> None:
    """Without `upgrade`, requests fail as 503 (JSON) and start-up fails; no table appears."""
    app = build_app(make_settings(tmp_path, database_url))

    bare = TestClient(app)  # no lifespan: only the request path
    response = bare.get("/v1/merges")
    assert response.status_code == 503
    assert response.headers["Retry-After"]
    assert response.json()["error"]["code"] == "database_unavailable"

    with pytest.raises(DBAPIError), TestClient(app):
        pass  # start-up resumes interrupted jobs, which needs the jobs table

    engine = create_engine(database_url)
    try:
        assert inspect(engine).get_table_names() == []
    finally:
        engine.dispose()
        app.state.context.db.dispose()


# --- claim: compare-and-set queued -> running ---------------------------------------------


def test_submit_writes_the_job_and_its_queued_event_together(
    store: tuple[Database, Settings],
) -> None:
    """One statement on PostgreSQL, one transaction on SQLite: the row as submit answers it, one
    `queued` event at the job's creation time, and nothing at all when the insert fails."""
    db, settings = store
    job, created = jobs.submit(
        db, settings, jobs.NewJob(TENANT, "merge", layer_swap(), None, "key-1")
    )
    assert created
    row = job_row(db, job.id)
    assert (row.status, row.idempotency_key, row.output_name, row.request) == (
        jobs.QUEUED, "key-1", job.output_name, job.request,
    )  # fmt: skip
    assert as_utc(row.created_at) == as_utc(job.created_at)
    with db.session() as session:
        events = session.scalars(select(JobEvent).where(JobEvent.job_id == job.id)).all()
        assert [(e.type, e.data, as_utc(e.created_at)) for e in events] == [
            (jobs.QUEUED, {}, as_utc(job.created_at))
        ]
        counts = (
            session.scalar(select(func.count()).select_from(JobEvent)),
            session.scalar(select(func.count()).select_from(Job)),
        )
    with pytest.raises(IntegrityError):  # no such tenant (a foreign key)
        jobs.submit(db, settings, jobs.NewJob("nobody", "merge", layer_swap(), None, None))
    with db.session() as session:
        assert (
            session.scalar(select(func.count()).select_from(JobEvent)),
            session.scalar(select(func.count()).select_from(Job)),
        ) == counts


def test_concurrent_claims_have_exactly_one_winner(pg_store: tuple[Database, Settings]) -> None:
    db, settings = pg_store
    job_id = new_job(db, settings)
    contenders = 8
    barrier = threading.Barrier(contenders)
    results: list[bool] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def contend() -> None:
        try:
            barrier.wait(timeout=30)
            won = jobs.claim(db, job_id) is not None
            with lock:
                results.append(won)
        except BaseException as e:  # surfaced below, not lost in the thread
            with lock:
                errors.append(e)

    threads = [threading.Thread(target=contend) for _ in range(contenders)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors, errors
    assert sorted(results) == [False] * (contenders - 1) + [True]

    job = job_row(db, job_id)
    assert job.status == jobs.RUNNING
    assert job.attempts == 1
    assert event_types(db, job_id).count(jobs.RUNNING) == 1


def test_claim_refuses_jobs_that_are_not_queued(pg_store: tuple[Database, Settings]) -> None:
    db, settings = pg_store

    running = new_job(db, settings)
    assert jobs.claim(db, running)
    assert not jobs.claim(db, running)
    assert job_row(db, running).attempts == 1

    succeeded = new_job(db, settings)
    set_state(db, succeeded, status=jobs.SUCCEEDED)
    assert not jobs.claim(db, succeeded)

    canceled = new_job(db, settings)
    assert jobs.request_cancel(db, tenant=TENANT, job_id=canceled).status == jobs.CANCELED
    assert not jobs.claim(db, canceled)

    # Queued but with a cancel already asked for (the cancel raced the claim): not taken.
    asked = new_job(db, settings)
    set_state(db, asked, cancel_requested=True)
    assert not jobs.claim(db, asked)

    for job_id, status in [
        (running, jobs.RUNNING),
        (succeeded, jobs.SUCCEEDED),
        (canceled, jobs.CANCELED),
        (asked, jobs.QUEUED),
    ]:
        job = job_row(db, job_id)
        assert job.status == status
        assert job.attempts == (1 if job_id == running else 0)
        assert event_types(db, job_id).count(jobs.RUNNING) == (1 if job_id == running else 0)


# --- run_job: a redelivered job runs once ------------------------------------------------


def copy_examples(settings: Settings, examples: Path) -> None:
    checkpoints = settings.source_roots[0]
    for name in ("base", "math", "swh"):
        shutil.copytree(examples / name, checkpoints / name)


def assert_ran_once(db: Database, settings: Settings, job_id: str) -> None:
    job = job_row(db, job_id)
    assert job.status == jobs.SUCCEEDED, job.error
    assert job.attempts == 1
    types = event_types(db, job_id)
    assert types.count(jobs.RUNNING) == 1
    assert types.count(jobs.SUCCEEDED) == 1
    out_dir = jobs.output_dir(settings, job)
    with db.session() as session:
        outputs = list(
            session.scalars(
                select(LineageEdge.artifact_id).where(
                    LineageEdge.job_id == job_id, LineageEdge.direction == "output"
                )
            )
        )
        assert outputs == [job.output_artifact_id]
        located = session.scalar(
            select(func.count()).select_from(Artifact).where(Artifact.location == str(out_dir))
        )
        assert located == 1
    # One output directory and no staging leftovers beside it.
    assert sorted(p.name for p in out_dir.parent.iterdir()) == [out_dir.name]


def test_redelivered_job_runs_once(store: tuple[Database, Settings], examples: Path) -> None:
    db, settings = store
    copy_examples(settings, examples)
    job_id = new_job(db, settings)

    run_job(job_id, db=db, settings=settings)
    assert_ran_once(db, settings, job_id)
    before = event_types(db, job_id)

    run_job(job_id, db=db, settings=settings)  # the same message, delivered again
    assert_ran_once(db, settings, job_id)
    assert event_types(db, job_id) == before


def test_concurrently_redelivered_job_runs_once(
    pg_store: tuple[Database, Settings], examples: Path
) -> None:
    db, settings = pg_store
    copy_examples(settings, examples)
    job_id = new_job(db, settings)
    workers = 4
    barrier = threading.Barrier(workers)
    errors: list[BaseException] = []

    def deliver() -> None:
        try:
            barrier.wait(timeout=30)
            run_job(job_id, db=db, settings=settings)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=deliver) for _ in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors
    assert_ran_once(db, settings, job_id)


# --- requeue_interrupted: what a restart does ---------------------------------------------


def test_requeue_interrupted(store: tuple[Database, Settings]) -> None:
    db, settings = store
    waiting = new_job(db, settings)
    interrupted = new_job(db, settings)
    exhausted = new_job(db, settings)
    canceling = new_job(db, settings)
    finished = new_job(db, settings)

    for job_id in (interrupted, exhausted, canceling):
        assert jobs.claim(db, job_id)
    set_state(db, exhausted, attempts=settings.max_attempts)
    assert jobs.request_cancel(db, tenant=TENANT, job_id=canceling).status == jobs.CANCELING
    set_state(db, finished, status=jobs.SUCCEEDED, attempts=1)

    assert jobs.requeue_interrupted(db) == [
        (waiting, "merge"),
        (interrupted, "merge"),
    ]  # oldest first

    job = job_row(db, interrupted)
    assert (job.status, job.attempts, job.stage) == (jobs.QUEUED, 1, None)
    assert event_types(db, interrupted)[-1] == jobs.QUEUED

    job = job_row(db, exhausted)
    assert (job.status, job.attempts) == (jobs.FAILED, settings.max_attempts)
    assert job.error is not None and job.error["code"] == "attempts_exhausted"
    assert job.finished_at is not None
    assert event_types(db, exhausted)[-1] == jobs.FAILED

    job = job_row(db, canceling)
    assert job.status == jobs.CANCELED
    assert job.finished_at is not None
    assert event_types(db, canceling)[-1] == jobs.CANCELED

    assert job_row(db, waiting).status == jobs.QUEUED
    assert job_row(db, finished).status == jobs.SUCCEEDED

    # The requeued job can be claimed again, as its second attempt.
    assert jobs.claim(db, interrupted)
    assert job_row(db, interrupted).attempts == 2
    # Interrupted again: requeued again, its attempts kept; settled jobs stay as they are.
    assert jobs.requeue_interrupted(db) == [(waiting, "merge"), (interrupted, "merge")]
    assert job_row(db, interrupted).attempts == 2
    assert job_row(db, exhausted).status == jobs.FAILED
    assert job_row(db, canceling).status == jobs.CANCELED


def test_requeue_interrupted_leaves_a_sibling_process_s_running_job(
    store: tuple[Database, Settings],
) -> None:
    """Several API processes on one database (serve --workers N): one starting up must not take
    back the job another is running (its heartbeat is fresh); a silent one it does."""
    db, settings = store
    running = new_job(db, settings)
    silent = new_job(db, settings)
    assert jobs.claim(db, running) and jobs.claim(db, silent)
    set_state(db, silent, heartbeat_at=utcnow() - timedelta(seconds=settings.stale_after_s + 5))
    since = utcnow() - timedelta(seconds=settings.stale_after_s)
    assert jobs.requeue_interrupted(db, silent_since=since) == [(silent, "merge")]
    assert jobs.get(db, tenant=TENANT, job_id=running).status == jobs.RUNNING
