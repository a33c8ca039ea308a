"""The reconciler: the database is the truth, the executor only delivers.

A loop in every API process that, each `reconcile_interval_s`:
- re-queues running jobs whose heartbeat is older than `stale_after_s` (their worker died or
  lost the database), or fails them once `max_attempts` are used up;
- re-dispatches queued jobs the executor no longer holds (a message lost with a Redis restart,
  a submit while Redis was down, a process that died between commit and publish);
- advances sweeps (service/sweeps/advance.py): cancels, clean-ups, further asks, their end.
Both steps are compare-and-set or idempotent, so any number of API processes may run it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

from sqlalchemy import select, update

from core import jobs
from core.db.models import Job, as_utc, utcnow
from core.db.session import Database
from core.jobs import Executor
from core.output_manifest import remove_orphan
from core.settings import Settings
from service.sweeps.advance import advance_all

log = logging.getLogger("layerswap.reconciler")


@dataclass
class Reconciled:
    requeued: list[str] = field(default_factory=list)
    redispatched: list[str] = field(default_factory=list)
    executor_unreachable: bool = False
    sweeps_ended: list[str] = field(default_factory=list)


class Reconciler:
    def __init__(self, db: Database, settings: Settings, executor: Executor) -> None:
        self.db, self.settings, self.executor = db, settings, executor
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layerswap-reconciler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.reconcile_interval_s):
            try:
                self.run_once()
            except Exception as e:  # boundary: the reconciler thread lives on
                log.warning("reconcile failed: %s", str(e).splitlines()[0] if str(e) else e)

    def run_once(self) -> Reconciled:
        done = Reconciled()
        for job_id, kind in requeue_stale(self.db, self.settings.stale_after_s, self.settings):
            log.warning("job %s: heartbeat stale; re-queued", job_id)
            self.executor.dispatch(job_id, kind)
            done.requeued.append(job_id)
        done.sweeps_ended = advance_all(self.db, self.settings, self.executor)
        # Jobs younger than one round may have a message in flight (being published, or just
        # popped by a worker that has not claimed it yet); they are looked at next round.
        grace = timedelta(seconds=max(1.0, self.settings.reconcile_interval_s))
        queued = jobs.queued(self.db, created_before=utcnow() - grace)
        if not queued:
            return done
        try:
            waiting = self.executor.pending()
        except Exception as e:  # boundary: whatever the executor's broker raises means "unknown"
            log.warning("executor unreachable (%s); queued jobs wait for it", e)
            done.executor_unreachable = True
            return done
        for job_id, kind in queued:
            if job_id not in waiting and job_id not in done.requeued:
                self.executor.dispatch(job_id, kind)
                done.redispatched.append(job_id)
        if done.redispatched:
            log.warning(
                "re-dispatched %d queued job(s) whose delivery was lost", len(done.redispatched)
            )
            with self.db.session() as session:
                for job_id in done.redispatched:
                    jobs.add_event(session, job_id, "redispatched", reason="delivery lost")
        return done


def requeue_stale(
    db: Database, stale_after_s: float, settings: Settings | None = None
) -> list[tuple[str, str]]:
    """Running jobs whose heartbeat is older than `stale_after_s` lost their worker: re-queue
    them (or fail them when out of attempts). Returns the re-queued (id, kind)s.

    Each row moves by a compare-and-set on (status, attempt, stale heartbeat), so reconcilers
    in several processes, or a worker that beats at the last moment, never double a job. With
    `settings`, a merge that ends here (canceled, or out of attempts) loses the output its lost
    attempt may have published: nothing will record it, and it would hold the name forever."""
    cutoff = utcnow() - timedelta(seconds=stale_after_s)
    with db.session() as session:
        stale = session.scalars(
            select(Job).where(Job.status.in_(jobs.ACTIVE), Job.heartbeat_at < cutoff)
        ).all()
    requeued = []
    for job in stale:
        silent = (utcnow() - (as_utc(job.heartbeat_at) or cutoff)).total_seconds()
        status, values, event = jobs.after_loss(job, f"no heartbeat for {silent:.0f} s")
        with db.session() as session:
            moved: Any = session.execute(
                update(Job)
                .where(
                    Job.id == job.id,
                    Job.status == job.status,
                    Job.attempts == job.attempts,
                    Job.heartbeat_at < cutoff,
                )
                .values(status=status, stage=None, **values)
            )
            if int(moved.rowcount) != 1:
                continue  # it beat, finished, or another reconciler took it
            jobs.add_event(session, job.id, status, **event)
        if status == jobs.QUEUED:
            requeued.append((job.id, job.kind))
        elif settings is not None and job.kind == "merge":
            _remove_orphan(jobs.output_dir(settings, job), job.id)
    return requeued


def _remove_orphan(out_dir: Path, job_id: str) -> None:
    if remove_orphan(out_dir, job_id):
        log.warning("job %s ended without succeeding: removed its output %s", job_id, out_dir)
