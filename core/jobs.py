"""Jobs: submit, read, list, cancel; the state machine; the Executor protocol.

queued -> running -> succeeded | failed | canceled, with canceling while a running job winds
down. Every transition is written with an event in the same transaction.
"""

from __future__ import annotations

import hashlib
import json
import logging
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy import Dialect, Select, and_, or_, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, joinedload

from core.changes import touched
from core.cursors import decode_cursor, encode_cursor
from core.db.models import Job, JobEvent, Tenant, utcnow
from core.db.session import Database
from core.errors import Conflict, IdempotencyConflict, NotFound
from core.job_inserts import insert_queued
from core.job_rows import (
    CREATED_AT,
    ID,
    driver_processors,
    driver_value,
    fetch,
    job_of,
    page_select,
    processed,
)
from core.output_manifest import output_owner, remove_orphan
from core.quota import check_room
from core.settings import Settings
from core.stored_requests import check_stored_size
from core.webhooks.outbox import job_ended

QUEUED, RUNNING, CANCELING = "queued", "running", "canceling"
SUCCEEDED, FAILED, CANCELED = "succeeded", "failed", "canceled"
TERMINAL = frozenset({SUCCEEDED, FAILED, CANCELED})
OUTPUT = joinedload(Job.output_artifact)  # read with the job: a view needs it (merges.read_job)
ACTIVE = frozenset({RUNNING, CANCELING})  # an attempt holds the job
# Stages past a running job's point of no return (worker/lease.py commit_point): it is making
# its output visible outside (a Hub commit, an MLflow version, an evaluation's card and scores),
# which a cancel could not take back, so a cancel is refused from there on.
COMMITTED_STAGES = frozenset({"committing", "registering", "recording"})
STATUSES = (QUEUED, RUNNING, CANCELING, SUCCEEDED, FAILED, CANCELED)

log = logging.getLogger("layerswap.outputs")  # free_name: an orphaned output it removed


class Executor(Protocol):
    """Runs jobs somewhere: in this process (local) or on Celery workers. Delivery may be lost
    or duplicated; the job row decides what runs (see claim) and the reconciler re-delivers."""

    def dispatch(self, job_id: str, kind: str) -> None: ...

    def pending(self) -> set[str]:
        """Ids of jobs whose delivery is still waiting (raises when that cannot be known)."""
        ...

    def start(self) -> None: ...

    def stop(self) -> None: ...


def new_id() -> str:
    return uuid.uuid4().hex


def is_id(value: str) -> bool:
    """Could this be an id? One with a NUL byte names nothing, and PostgreSQL refuses it in a
    query (an error, not a miss), so it is never sent there."""
    return "\0" not in value


def request_digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def add_event(session: Session, job_id: str, type_: str, **data: Any) -> None:
    """Record a job's event; a job's end also queues its webhooks, in the same transaction."""
    session.add(JobEvent(job_id=job_id, type=type_, data=data))
    touched(session, job_id)
    if type_ in TERMINAL:
        job_ended(session, job_id, type_, data)


def ensure_tenant(db: Database, tenant: str) -> None:
    try:
        with db.session() as session:
            if session.get(Tenant, tenant) is None:
                session.add(Tenant(id=tenant))
    except IntegrityError:
        pass  # a concurrent request created it first: that is fine


@dataclass(frozen=True)
class NewJob:
    tenant: str
    kind: str
    request: dict[str, Any]  # what runs (Hub sources pinned to commit shas)
    output_name: str | None
    idempotency_key: str | None
    asked: dict[str, Any] | None = None  # the body as sent, for idempotency (default: request)
    sources: list[dict[str, str]] | None = None  # Hub pins
    # The output's size as planned from local inputs' headers (0: not known at submit): it
    # must fit the tenant's quota too.
    planned_bytes: int = 0


def submit(db: Database, settings: Settings, new: NewJob) -> tuple[Job, bool]:
    """Insert a queued job (or return the one this idempotency key already made); a request
    too large to store is refused first (RequestTooLarge)."""
    check_stored_size(new.request, settings)
    digest = request_digest({"kind": new.kind, **(new.asked or new.request)})
    job_id = new_id()
    name = new.output_name or f"{new.kind}-{job_id[:12]}"
    try:
        # Checks first, each read its own (none of them is made safe by a transaction: the
        # unique key decides between concurrent retries, quotas are checked against what is
        # stored). Most submits read only the tenant's usage here (its records' sum is reused
        # for a while: core/quota.py): no key, no output of that name.
        with db.session() as session:
            if new.idempotency_key and (found := _by_key(session, new, digest)):
                return found, False  # a retry: its job may well have written the output
            check_room(session, settings, new.tenant, new.planned_bytes)
            if new.kind == "merge":
                free_name(session, _output_dir(settings, new.tenant, name), new.tenant)
        return Job(**_insert_queued(db, new, job_id, name, digest, settings.max_attempts)), True
    except IntegrityError:
        # A concurrent request with the same key committed first: answer with its job.
        with db.session() as session:
            found = _by_key(session, new, digest) if new.idempotency_key else None
        if found is None:
            raise
        return found, False


def _insert_queued(
    db: Database, new: NewJob, job_id: str, name: str, digest: str, max_attempts: int
) -> dict[str, Any]:
    """Insert a submitted job and its `queued` event, atomically (core/job_inserts.py), and
    return the job row's values. No change notification: nothing can be waiting on a job whose
    id no one has been told yet."""
    row = {
        "id": job_id, "tenant_id": new.tenant, "kind": new.kind, "status": QUEUED,
        "stage": None, "request": new.request, "request_hash": digest,
        "idempotency_key": new.idempotency_key, "output_name": name,
        "max_attempts": max_attempts, "sources": new.sources, "bytes_done": 0,
        "bytes_total": 0, "tensors_done": 0, "tensors_total": 0, "attempts": 0,
        "cancel_requested": False, "created_at": utcnow(),
    }  # fmt: skip
    insert_queued(db, row)
    return row


def add_queued(
    session: Session,
    settings: Settings,
    *,
    tenant: str,
    kind: str,
    request: dict[str, Any],
    output_name: str | None = None,
    sweep_id: str | None = None,
    **event: Any,
) -> Job:
    """A queued job made by the service itself (a merge's evaluation, a sweep's trials) in the
    caller's transaction; the reconciler dispatches it if the caller does not."""
    job_id = new_id()
    job = Job(
        id=job_id,
        tenant_id=tenant,
        kind=kind,
        status=QUEUED,
        request=request,
        request_hash=request_digest({"kind": kind, **request}),
        output_name=output_name or f"{kind}-{job_id[:12]}",
        max_attempts=settings.max_attempts,
        sweep_id=sweep_id,
    )
    session.add(job)
    session.flush()
    add_event(session, job_id, QUEUED, **event)
    return job


def _by_key(session: Session, new: NewJob, digest: str) -> Job | None:
    job = session.scalars(
        select(Job).where(Job.tenant_id == new.tenant, Job.idempotency_key == new.idempotency_key)
    ).first()
    if job is not None and job.request_hash != digest:
        raise IdempotencyConflict(
            "Idempotency-Key was already used with a different request body",
            details={"job_id": job.id},
        )
    return job


def _output_dir(settings: Settings, tenant: str, name: str) -> Path:
    return settings.artifacts_dir / tenant / name


def output_dir(settings: Settings, job: Job) -> Path:
    return _output_dir(settings, job.tenant_id, job.output_name)


def get(db: Database, *, tenant: str, job_id: str, kind: str | None = None) -> Job:
    with db.session() as session:
        found = session.get(Job, job_id, options=[OUTPUT]) if is_id(job_id) else None
        if found is None or found.tenant_id != tenant or (kind and found.kind != kind):
            raise NotFound(f"no such job: {job_id}")
        return found


def list_jobs(
    db: Database,
    *,
    tenant: str,
    kind: str,
    status: str | None,
    artifact: tuple[str, str] | None,  # (direction, artifact id)
    cursor: str | None,
    limit: int,
) -> tuple[list[Job], str | None]:
    """Newest first, each a detached Job with its output artifact loaded; `cursor` continues
    after the last job of the previous page.

    Keyset pagination: the page is the first `limit` entries after the cursor's (created_at,
    id) of the index on (tenant_id, kind[, status], created_at, id), read backwards; no page
    costs more than the rows it shows, and jobs submitted meanwhile (newer) never shift it."""
    page = page_query(tenant=tenant, kind=kind, status=status, artifact=artifact,
                      cursor=cursor, limit=limit)  # fmt: skip
    dialect = db.engine.dialect
    rows, next_cursor = page_of(dialect, [] if page is None else fetch(db, *page), limit)
    processors = driver_processors(dialect)
    return [job_of(processed(row, processors)) for row in rows], next_cursor


def page_of(
    dialect: Dialect, rows: list[Sequence[Any]], limit: int
) -> tuple[list[Sequence[Any]], str | None]:
    """A page from the rows a page_query read (one more than `limit`, when there are more):
    its rows, and the cursor of the next page (None: this is the last)."""
    if len(rows) <= limit:
        return rows, None
    del rows[limit:]
    created_at, job_id = driver_value(dialect, rows[-1], CREATED_AT), rows[-1][ID]
    return rows, encode_cursor(created_at, job_id)


def page_query(
    *,
    tenant: str,
    kind: str,
    status: str | None,
    artifact: tuple[str, str] | None,
    cursor: str | None,
    limit: int,
) -> tuple[Select[*tuple[Any, ...]], dict[str, Any]] | None:
    """The statement (job_rows.page_select) and parameters that read a page of `limit` rows,
    and one more if there are more (page_of); None when no job can be on it (an artifact id
    that names nothing). Raises InvalidRequest for a cursor this API did not make."""
    params: dict[str, Any] = {"tenant": tenant, "kind": kind, "limit": limit + 1}
    if status:
        params["status"] = status
    if artifact:
        params["direction"], params["artifact_id"] = artifact
        if not is_id(params["artifact_id"]):
            return None
    if cursor:
        params["created_at"], params["last_id"] = decode_cursor(cursor)
    return page_select(status=bool(status), artifact=bool(artifact), after=bool(cursor)), params


def cancelable() -> Any:
    """The SQL condition of a job whose stage is not past its point of no return."""
    return or_(Job.stage.is_(None), Job.stage.not_in(COMMITTED_STAGES))


def request_cancel(db: Database, *, tenant: str, job_id: str) -> Job:
    """Queued jobs stop at once; running ones are asked to stop (checked between tensors) and
    then end canceled, leaving no output. Too late (the job ended, or passed its point of no
    return): Conflict, and the job goes on as it would have.

    Each move is a compare-and-set UPDATE on the status, never a read then a write: a job
    that finishes meanwhile is not flipped to canceled (on SQLite, whose `FOR UPDATE` is a
    no-op, the read and the write could straddle the worker's commit). The running move and
    the worker's commit_point and success are compare-and-sets on the same row, so exactly one
    of them wins."""
    if not is_id(job_id):
        raise NotFound(f"no such job: {job_id}")
    mine = and_(Job.id == job_id, Job.tenant_id == tenant)
    moves = (
        (QUEUED, {"status": CANCELED, "finished_at": utcnow()}, CANCELED),
        (RUNNING, {"status": CANCELING}, CANCELING),
    )
    with db.session() as session:
        for _ in range(3):  # a move can lose to a claim or a re-queue: look again
            for before, values, event in moves:
                where = mine if before == QUEUED else and_(mine, cancelable())
                moved: Any = session.execute(
                    update(Job)
                    .where(where, Job.status == before)
                    .values(cancel_requested=True, **values)
                )
                if int(moved.rowcount) == 1:
                    reason = {"reason": "canceled before it started"} if before == QUEUED else {}
                    add_event(session, job_id, event, **reason)
                    return _fresh(session, job_id)
            job = _cancel_refused(session, tenant=tenant, job_id=job_id)
            if job is not None:
                return job  # asked before: nothing more to do
        raise Conflict(f"job {job_id} keeps changing state; retry", details={"field": "job_id"})


def _cancel_refused(session: Session, *, tenant: str, job_id: str) -> Job | None:
    """After both moves missed: the job when it is already canceling; None when it moved
    meanwhile (look again); NotFound, or Conflict when it is too late to cancel."""
    job = session.get(Job, job_id, populate_existing=True)
    if job is None or job.tenant_id != tenant:
        raise NotFound(f"no such job: {job_id}")
    if job.status in TERMINAL:
        raise Conflict(f"job {job_id} already {job.status}", details={"status": job.status})
    if job.status == CANCELING:
        return job
    if job.status == RUNNING and job.stage in COMMITTED_STAGES:
        raise Conflict(
            f"job {job_id} can no longer be canceled: it is past its point of no return "
            f"(stage {job.stage}: its output is being made visible) and will finish",
            details={"status": job.status, "stage": job.stage},
        )
    return None


def _fresh(session: Session, job_id: str) -> Job:
    job = session.get(Job, job_id, populate_existing=True)
    assert job is not None
    return job


def claim(db: Database, job_id: str) -> int | None:
    """Compare-and-set queued -> running; the new attempt number, or None if this delivery
    lost (the job is running elsewhere, finished, canceled, or unknown)."""
    with db.session() as session:
        now = utcnow()
        result: Any = session.execute(
            update(Job)
            .where(Job.id == job_id, Job.status == QUEUED, Job.cancel_requested.is_(False))
            .values(
                status=RUNNING,
                attempts=Job.attempts + 1,
                started_at=now,
                heartbeat_at=now,
                stage="planning",
            )
        )
        if int(result.rowcount) != 1:
            return None
        job = session.get(Job, job_id)
        assert job is not None
        add_event(session, job_id, RUNNING, attempt=job.attempts)
        return job.attempts


def events(db: Database, *, tenant: str, job_id: str, after: int = 0) -> list[JobEvent]:
    get(db, tenant=tenant, job_id=job_id)
    with db.session() as session:
        return list(
            session.scalars(
                select(JobEvent)
                .where(JobEvent.job_id == job_id, JobEvent.id > after)
                .order_by(JobEvent.id)
            )
        )


def requeue_interrupted(
    db: Database, *, silent_since: datetime | None = None
) -> list[tuple[str, str]]:
    """At start-up of the in-process executor: jobs left running by a dead process go back to
    the queue (or fail when out of attempts); return every queued (id, kind), oldest first.
    With `silent_since` (several API processes may share the database), only jobs whose
    heartbeat stopped before then: a sibling process's running job is left alone."""
    query = select(Job).where(Job.status.in_(ACTIVE))
    if silent_since is not None:
        query = query.where(or_(Job.heartbeat_at.is_(None), Job.heartbeat_at < silent_since))
    with db.session() as session:
        for job in session.scalars(query):
            _give_back(session, job, "the process running it stopped")
    return queued(db)


def after_loss(job: Job, why: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """An attempt was lost: canceling -> canceled; out of attempts -> failed; else queued.
    Returns the new status, the columns to set and the event's data."""
    if job.status == CANCELING:
        reason = f"{why} while canceling"
        return CANCELED, {"finished_at": utcnow()}, {"reason": reason, "attempt": job.attempts}
    if job.attempts >= job.max_attempts:
        error = {
            "code": "attempts_exhausted",
            "message": f"attempt {job.attempts} of {job.max_attempts} was lost ({why}); giving up",
        }
        return FAILED, {"finished_at": utcnow(), "error": error}, dict(error)
    return QUEUED, {}, {"reason": f"re-queued: {why}", "attempt": job.attempts}


def _give_back(session: Session, job: Job, why: str) -> None:
    status, values, event = after_loss(job, why)
    job.status, job.stage = status, None
    for key, value in values.items():
        setattr(job, key, value)
    add_event(session, job.id, status, **event)


def queued(db: Database, *, created_before: datetime | None = None) -> list[tuple[str, str]]:
    """(id, kind) of queued jobs, oldest first."""
    query = select(Job.id, Job.kind).where(Job.status == QUEUED)
    if created_before is not None:
        query = query.where(Job.created_at < created_before)
    with db.session() as session:
        return [(row.id, row.kind) for row in session.execute(query.order_by(Job.created_at))]


def free_name(session: Session, out_dir: Path, tenant: str) -> None:
    """409 if an output already holds this name, unless that output is an orphan: published by
    a job of this tenant's that then ended without succeeding (its manifest names the job),
    which is removed. Never another job's live output, nor a succeeded job's."""
    if not out_dir.exists():
        return
    owner_id = output_owner(out_dir)
    owner = session.get(Job, owner_id) if owner_id and is_id(owner_id) else None
    if owner is None or owner.tenant_id != tenant or owner.status not in (FAILED, CANCELED):
        raise Conflict(
            f"output.name: an artifact named {out_dir.name!r} already exists",
            details={"field": "output.name"},
        )
    remove_orphan(out_dir, owner.id)
    log.warning("job %s ended %s: removed its orphaned output %s", owner.id, owner.status, out_dir)
