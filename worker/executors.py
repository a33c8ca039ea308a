"""Executors deliver job ids to run_job: `local` on a thread of this process, `celery` through
Redis to worker processes (`layerswap worker`)."""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from datetime import timedelta
from typing import Any

from kombu.exceptions import OperationalError

from core import jobs
from core.db.models import utcnow
from core.db.session import Database
from core.settings import Settings
from worker.celery_app import TASK_NAME, make_celery, queue_for, queue_lengths, waiting_job_ids
from worker.pipeline import run_job

log = logging.getLogger("layerswap.executor")
PUBLISH_BATCH = 256  # most messages sent in one Redis pipeline
STOP_WAIT_S = 3.0  # how long a stopping API process waits for its job to be handed back


def make_executor(db: Database, settings: Settings) -> LocalExecutor | CeleryExecutor:
    """The executor `settings.executor` names: `celery`, or the embedded default `local`."""
    if settings.executor == "celery":
        return CeleryExecutor(settings)
    return LocalExecutor(db, settings)


class LocalExecutor:
    """One job at a time on a daemon thread; on start, resumes what a previous process left."""

    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="layerswap-jobs", daemon=True)
        self._current: str | None = None
        self._stopping = threading.Event()

    def start(self) -> None:
        self._thread.start()
        # SQLite: this is the only process, so whatever is running was left by a dead one. On
        # PostgreSQL sibling API processes (serve --workers N) may be running jobs: only the
        # silent ones are taken back now, the rest by the reconciler once their heartbeat stops.
        silent_since = None
        if not self.db.is_sqlite:
            silent_since = utcnow() - timedelta(seconds=self.settings.stale_after_s)
        for job_id, kind in jobs.requeue_interrupted(self.db, silent_since=silent_since):
            self.dispatch(job_id, kind)

    def dispatch(self, job_id: str, kind: str) -> None:
        self._queue.put(job_id)

    def pending(self) -> set[str]:
        with self._queue.mutex:
            waiting = {job_id for job_id in self._queue.queue if job_id is not None}
        current = self._current
        return waiting | ({current} if current else set())

    def health(self) -> dict[str, Any]:
        """Its worker thread and the jobs waiting for it (GET /v1/executor)."""
        with self._queue.mutex:
            waiting = sum(1 for job_id in self._queue.queue if job_id is not None)
        thread = self._thread
        worker = {"name": thread.name, "alive": thread.is_alive(), "job_id": self._current}
        return {"executor": "local", "workers": [worker], "queues": {"local": waiting}}

    def stop(self) -> None:
        """The running job, if any, stops and goes back to the queue (worker/stopping.py),
        waited for STOP_WAIT_S at most: past that the process ends anyway, and the job is
        resumed as after a crash (on the next start, or by a sibling API process's
        reconciler)."""
        self._stopping.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout=STOP_WAIT_S)

    def idle(self) -> bool:
        return self._queue.unfinished_tasks == 0

    def _loop(self) -> None:
        while (job_id := self._queue.get()) is not None:
            self._current = job_id
            try:
                if not self._stopping.is_set():  # else it stays queued, for the next start
                    run_job(job_id, db=self.db, settings=self.settings, stopping=self._stopping)
            except Exception:  # the job thread's loop (the database went away, say): keep serving
                log.exception("job %s could not be run", job_id)
            finally:
                self._current = None
                self._queue.task_done()
        self._queue.task_done()


class CeleryExecutor:
    """Publishes job ids to Redis from a thread of its own, so a submit never waits on the
    broker: a job whose message cannot be sent (Redis down) stays queued in the database and the
    reconciler sends it again once Redis answers."""

    def __init__(self, settings: Settings) -> None:
        self.app = make_celery(settings, publisher=True)
        self._outbox: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._publish_loop, name="layerswap-publish")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._outbox.put(None)
        self._thread.join(timeout=10)

    def dispatch(self, job_id: str, kind: str) -> None:
        self._outbox.put((job_id, kind))

    def broker_reachable(self) -> bool:
        """Whether a connection to the broker opens (one retry, 2 s at most): the readiness
        probe's answer. kombu raises its OperationalError for what it retried; the rest of the
        transport's connection errors are caught too."""
        with self.app.connection_for_read() as connection:
            unreachable: tuple[type[BaseException], ...] = (
                OperationalError,
                *connection.connection_errors,
            )
            try:
                connection.ensure_connection(max_retries=1, timeout=2)
            except unreachable:
                return False
        return True

    def health(self) -> dict[str, Any]:
        """The broker's queue lengths (None while it cannot be reached) and the job ids not
        yet sent to it (GET /v1/executor). Workers are not asked: they take no remote control
        (worker/celery_app.py); the jobs they run show their heartbeats instead."""
        with self._outbox.mutex:
            unsent = sum(1 for item in self._outbox.queue if item is not None)
        lengths: dict[str, int] | None = None
        if self.broker_reachable():
            try:
                lengths = queue_lengths(self.app)
            except Exception as e:  # boundary: the broker went away since, whatever it raises
                log.warning("queue lengths unknown: %s", e)
        return {
            "executor": "celery",
            "workers": None,
            "queues": lengths,
            "unsent": unsent,
            "broker": "ok" if lengths is not None else "unreachable",
        }

    def pending(self) -> set[str]:
        with self._outbox.mutex:
            unsent = {item[0] for item in self._outbox.queue if item is not None}
        return unsent | waiting_job_ids(self.app)

    def _publish_loop(self) -> None:
        while (first := self._outbox.get()) is not None:
            batch, stopping = self._take_batch(first)
            self._send(batch)
            if stopping:
                return

    def _take_batch(self, first: tuple[str, str]) -> tuple[list[tuple[str, str]], bool]:
        """`first` and every message waiting now (up to PUBLISH_BATCH), and whether the stop
        sentinel was among them. One batch is one Redis pipeline (one round trip, one client)
        instead of a client, a connection checkout and a round trip each, which was most of a
        submit's publishing cost under load."""
        batch = [first]
        while len(batch) < PUBLISH_BATCH:
            try:
                item = self._outbox.get_nowait()
            except queue.Empty:
                break
            if item is None:
                return batch, True
            batch.append(item)
        return batch, False

    def _send(self, batch: list[tuple[str, str]]) -> None:
        try:
            with self.app.producer_or_acquire() as producer, producer.batch():
                for job_id, kind in batch:
                    self.app.send_task(
                        TASK_NAME,
                        args=[job_id],
                        queue=queue_for(kind),
                        task_id=f"{job_id}.{uuid.uuid4().hex[:8]}",
                        retry=False,
                        producer=producer,
                    )
        # The publishing thread's boundary: with retry=False the transport's own errors (kombu's,
        # redis', a socket's) arrive unwrapped, and none may stop the thread.
        except Exception as e:
            # Whether any of the batch reached Redis is unknown: each job is still queued
            # in the database, and a duplicate delivery does nothing (the claim).
            log.warning(
                "%d job(s) (%s): broker unreachable (%s); they stay queued and are re-sent "
                "by the reconciler",
                len(batch),
                ", ".join(job_id for job_id, _ in batch[:5]) + (", ..." if len(batch) > 5 else ""),
                str(e).splitlines()[0] if str(e) else type(e).__name__,
            )
