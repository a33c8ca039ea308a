"""A job attempt's lease: heartbeats, throttled progress, the cancel flag, and writes fenced
by attempt so that an attempt presumed dead can change nothing."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from sqlalchemy import and_, select, update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from core import jobs
from core.changes import touched
from core.db.models import Job, utcnow
from core.db.session import Database
from core.settings import Settings
from engine.errors import MergeCanceled
from engine.progress import Progress

log = logging.getLogger("layerswap.pipeline")
EVENT_INTERVAL_S = 2.0


class LeaseLost(Exception):
    """The job was given to another attempt (this one was presumed dead) or finished."""


class JobLease:
    """One attempt's hold on its job: heartbeats, throttled progress and the cancel flag.

    Every write is fenced by (status running|canceling, attempts == this attempt): once the
    reconciler has handed the job to another attempt, this one can change nothing, and it stops
    at its next cancel check. Heartbeats come from their own thread, so a long step with no
    progress (an fsync, a huge tensor) never makes a live job look dead. A database that is
    briefly away costs some heartbeats and progress rows, never the merge.

    The cancel flag is the job row's (a cancel may come through any API process, and a Celery
    worker is another process): should_cancel reads it at most every cancel_check_interval_s,
    the heartbeat on each beat.

    `stopping`, once set (the process is stopping: worker/stopping.py), stops the attempt at
    the same checks as a cancel.
    """

    def __init__(
        self,
        db: Database,
        job_id: str,
        attempt: int,
        settings: Settings,
        stopping: threading.Event | None = None,
    ) -> None:
        self.db, self.job_id, self.attempt = db, job_id, attempt
        self._stopping = threading.Event() if stopping is None else stopping  # None: never set
        self.progress_interval = settings.progress_interval_s
        self.heartbeat_interval = settings.heartbeat_interval_s
        self.check_interval = settings.cancel_check_interval_s
        self.retry_s = settings.db_retry_s
        self.lost = self.cancel = False
        self._written = self._event = 0.0
        self._checked = -math.inf  # the first check reads the flag
        self._checking = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id[:8]}")

    def __enter__(self) -> JobLease:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def mine(self) -> Any:
        """The SQL condition of this attempt's hold on its job."""
        return and_(
            Job.id == self.job_id, Job.attempts == self.attempt, Job.status.in_(jobs.ACTIVE)
        )

    def fenced(self) -> Any:
        return update(Job).where(self.mine())

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                with self.db.session() as session:
                    row = session.execute(
                        self.fenced().values(heartbeat_at=utcnow()).returning(Job.cancel_requested)
                    ).first()
            except SQLAlchemyError as e:
                log.warning("job %s: heartbeat not written (%s)", self.job_id, brief(e))
                continue
            if row is None:
                log.warning(
                    "job %s: attempt %d lost its lease; stopping", self.job_id, self.attempt
                )
                self.lost = True
                return
            self.cancel = bool(row[0])

    def should_cancel(self) -> bool:
        """The engine's check between tensors (and the downloads' between chunks): the flag as
        read from the row at most every check_interval, from whichever thread asks first; the
        others meanwhile take the last value read."""
        if not (self.cancel or self.lost) and self._due() and self._checking.acquire(False):
            try:
                self._read_flag()
            finally:
                self._checking.release()
        return self.cancel or self.lost or self.stopping

    @property
    def stopping(self) -> bool:
        """The process running this attempt is stopping."""
        return self._stopping.is_set()

    def _due(self) -> bool:
        return time.monotonic() - self._checked >= self.check_interval

    def _read_flag(self) -> None:
        self._checked = time.monotonic()
        try:
            with self.db.session() as session:
                asked = session.scalar(select(Job.cancel_requested).where(self.mine()))
        except SQLAlchemyError as e:  # the heartbeat reads it too; the next check may answer
            log.warning("job %s: cancel flag not read (%s)", self.job_id, brief(e))
            return
        if asked is None:
            return  # no longer this attempt's: the heartbeat finds out and stops it
        self.cancel = self.cancel or bool(asked)

    def set_stage(self, stage: str) -> None:
        """Enter `stage` (best effort); never over a stage past the point of no return."""
        try:
            with self.db.session() as session:
                session.execute(
                    self.fenced()
                    .where(jobs.cancelable())
                    .values(stage=stage, heartbeat_at=utcnow())
                )
                touched(session, self.job_id)
        except SQLAlchemyError as e:
            log.warning("job %s: stage not written (%s)", self.job_id, brief(e))

    def commit_point(self, stage: str) -> None:
        """The point of no return: enter `stage` (one of jobs.COMMITTED_STAGES) unless a cancel
        was accepted first, as one compare-and-set, after which a cancel is refused. Raises
        MergeCanceled when it was (the caller removes what it made), LeaseLost when the job
        moved on. Asked again (a retried step), it stays where it is."""

        def write(session: Session) -> None:
            moved: Any = session.execute(
                self.fenced()
                .where(Job.status == jobs.RUNNING, Job.cancel_requested.is_(False))
                .values(stage=stage, heartbeat_at=utcnow())
            )
            if int(moved.rowcount) != 1:
                _refused(session, self)
            touched(session, self.job_id)

        write_with_retry(self.db, self, write, self.retry_s)

    def stage_progress(self, stage: str) -> Callable[[int, int], None]:
        """Enter `stage`; the sink its (done, total) progress goes to (requests or bytes), with
        the time since the stage began (for the ETA)."""
        self.set_stage(stage)
        started = time.monotonic()

        def report(done: int, total: int) -> None:
            self.progress(Progress(stage, done, total, 0, 0, time.monotonic() - started))

        return report

    def progress(self, p: Progress) -> None:
        now = time.monotonic()
        if now - self._written < self.progress_interval and p.bytes_done < p.bytes_total:
            return
        self._written = now
        counts = {
            "stage": p.stage,
            "bytes_done": p.bytes_done,
            "bytes_total": p.bytes_total,
            "tensors_done": p.tensors_done,
            "tensors_total": p.tensors_total,
        }
        try:
            with self.db.session() as session:
                # Not once canceling (the job's events then end canceling -> canceled), nor
                # over a stage past the point of no return.
                written = session.execute(
                    self.fenced()
                    .where(Job.status == jobs.RUNNING, jobs.cancelable())
                    .values(heartbeat_at=utcnow(), **counts)
                )
                if int(getattr(written, "rowcount", 0)) == 1:
                    touched(session, self.job_id)  # long polls see progress as it is written
                if int(getattr(written, "rowcount", 0)) == 1 and (
                    now - self._event >= EVENT_INTERVAL_S or p.bytes_done >= p.bytes_total
                ):
                    self._event = now
                    jobs.add_event(session, self.job_id, "progress", **counts)
        except SQLAlchemyError as e:  # progress is best effort; the next write catches up
            log.warning("job %s: progress not written (%s)", self.job_id, brief(e))


def settle(session: Session, lease: JobLease, **values: Any) -> Job:
    """This attempt's final move, as one compare-and-set UPDATE fenced by (attempt, status
    running|canceling); the row as it now is, or LeaseLost when the job moved on (re-queued,
    given up, or finished) first. Never a read then a write: on SQLite, whose `FOR UPDATE` does
    nothing, the two could straddle the reconciler's commit. The UPDATE also holds the row (the
    database, on SQLite) until the caller's transaction ends, so what it writes next with the
    returned row (lineage, events) lands only where the move did."""
    moved: Any = session.execute(lease.fenced().values(**values))
    if int(moved.rowcount) != 1:
        raise LeaseLost(lease.job_id)
    job = session.get(Job, lease.job_id, populate_existing=True)
    assert job is not None
    return job


def settle_succeeded(session: Session, lease: JobLease, **values: Any) -> Job:
    """settle, as succeeded: the point of no return of a job that has nothing to make visible
    outside first. The compare-and-set also needs status running and no cancel asked:
    MergeCanceled when one was (the caller removes what it made, then records canceled),
    LeaseLost when the job moved on. Either way this transaction has written nothing."""
    moved: Any = session.execute(
        lease.fenced()
        .where(Job.status == jobs.RUNNING, Job.cancel_requested.is_(False))
        .values(status=jobs.SUCCEEDED, **values)
    )
    if int(moved.rowcount) != 1:
        _refused(session, lease)
    job = session.get(Job, lease.job_id, populate_existing=True)
    assert job is not None
    return job


def _refused(session: Session, lease: JobLease) -> NoReturn:
    """Why a compare-and-set that needs no cancel missed: MergeCanceled when this attempt's
    job is canceling, LeaseLost otherwise."""
    status = session.scalar(select(Job.status).where(lease.mine()))
    if status == jobs.CANCELING:
        lease.cancel = True
        raise MergeCanceled("canceled before the output was recorded")
    raise LeaseLost(lease.job_id)


def write_with_retry(
    db: Database, lease: JobLease, write: Callable[[Session], None], budget_s: float
) -> None:
    """The final write of an attempt survives a database restart: retried with backoff for
    `budget_s`. Past that the job stays running, its heartbeat goes stale, and the reconciler
    hands it to a new attempt (which adopts the output this one published)."""
    deadline, pause = time.monotonic() + budget_s, 0.2
    while True:
        try:
            with db.session() as session:
                write(session)
            return
        except (OperationalError, InterfaceError) as e:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("job %s: database unavailable (%s); retrying", lease.job_id, brief(e))
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def brief(error: Exception) -> str:
    return str(error).splitlines()[0][:200]
