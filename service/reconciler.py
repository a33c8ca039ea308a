"""The reconciler: the database is the truth, the executor only delivers.

A loop in every API process that, each `reconcile_interval_s`:
- re-queues running jobs whose heartbeat is older than `stale_after_s` (their worker died or
  lost the database), or fails them once `max_attempts` are used up;
- re-dispatches queued jobs the executor no longer holds (a message lost with a Redis restart,
  a submit while Redis was down, a process that died between commit and publish).
Both steps are compare-and-set or idempotent, so any number of API processes may run it.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from datetime import timedelta

from service import jobs
from service.db.models import utcnow
from service.db.session import Database
from service.jobs import Executor
from service.settings import Settings

log = logging.getLogger("layerswap.reconciler")


@dataclass
class Reconciled:
    requeued: list[str] = field(default_factory=list)
    redispatched: list[str] = field(default_factory=list)
    executor_unreachable: bool = False


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
            except Exception as e:  # the database is away, say: try again next round
                log.warning("reconcile failed: %s", str(e).splitlines()[0] if str(e) else e)

    def run_once(self) -> Reconciled:
        done = Reconciled()
        for job_id, kind in jobs.requeue_stale(self.db, self.settings.stale_after_s, self.settings):
            log.warning("job %s: heartbeat stale; re-queued", job_id)
            self.executor.dispatch(job_id, kind)
            done.requeued.append(job_id)
        # Jobs younger than one round may have a message in flight (being published, or just
        # popped by a worker that has not claimed it yet); they are looked at next round.
        grace = timedelta(seconds=max(1.0, self.settings.reconcile_interval_s))
        queued = jobs.queued(self.db, created_before=utcnow() - grace)
        if not queued:
            return done
        try:
            waiting = self.executor.pending()
        except Exception as e:
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
