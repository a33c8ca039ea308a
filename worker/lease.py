"""A job attempt's lease: heartbeats, throttled progress, the cancel flag, and writes fenced
by attempt so that an attempt presumed dead can change nothing."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from core import jobs
from core.changes import touched
from core.db.models import Job, utcnow
from core.db.session import Database
from core.settings import Settings
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
    """

    def __init__(self, db: Database, job_id: str, attempt: int, settings: Settings) -> None:
        self.db, self.job_id, self.attempt = db, job_id, attempt
        self.progress_interval = settings.progress_interval_s
        self.heartbeat_interval = settings.heartbeat_interval_s
        self.lost = self.cancel = False
        self._written = self._event = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id[:8]}")

    def __enter__(self) -> JobLease:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def fenced(self) -> Any:
        return update(Job).where(
            Job.id == self.job_id, Job.attempts == self.attempt, Job.status.in_(jobs.ACTIVE)
        )

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
        return self.cancel or self.lost

    def set_stage(self, stage: str) -> None:
        try:
            with self.db.session() as session:
                session.execute(self.fenced().values(stage=stage, heartbeat_at=utcnow()))
                touched(session, self.job_id)
        except SQLAlchemyError as e:
            log.warning("job %s: stage not written (%s)", self.job_id, brief(e))

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
                written = session.execute(self.fenced().values(heartbeat_at=utcnow(), **counts))
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
