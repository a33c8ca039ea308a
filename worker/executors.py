"""Executors deliver job ids to run_job. `local` runs them on a thread of this process."""

from __future__ import annotations

import logging
import queue
import threading

from service import jobs
from service.db.session import Database
from service.settings import Settings
from worker.pipeline import run_job

log = logging.getLogger("layerswap.executor")


class LocalExecutor:
    """One job at a time on a daemon thread; on start, resumes what a previous process left."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="layerswap-jobs", daemon=True)

    def start(self) -> None:
        self._thread.start()
        for job_id in jobs.requeue_interrupted(self.db):
            self.dispatch(job_id)

    def dispatch(self, job_id: str) -> None:
        self._queue.put(job_id)

    def stop(self) -> None:
        # A running merge is not waited for: its job is resumed on the next start.
        self._queue.put(None)

    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def _loop(self) -> None:
        while (job_id := self._queue.get()) is not None:
            try:
                run_job(job_id, db=self.db, settings=self.settings)
            except Exception:  # the database went away mid-job, say: keep serving
                log.exception("job %s could not be run", job_id)
            finally:
                self._queue.task_done()
        self._queue.task_done()
