"""Who waits for a job to change (long polls, event streams) is woken when it does, instead of
polling the database.

- In the process that changed it: `touched(session, job_id)` marks the job in the session, and
  after that session commits every waiter on the job is woken (the local executor runs jobs in
  the API process).
- Across processes, on PostgreSQL: the same transaction sends NOTIFY layerswap_jobs '<job id>',
  delivered at commit; each API process LISTENs on one connection (`Listener`) and wakes its
  waiters, so a job run by a Celery worker or another API process wakes them too.

A wake-up only says "look again": waiters re-read the job, so a missed or spurious one costs a
read, never a wrong answer (and waits have a timeout)."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import defaultdict

import psycopg
from sqlalchemy import event, text
from sqlalchemy.orm import Session

log = logging.getLogger("layerswap.changes")
CHANNEL = "layerswap_jobs"


class Changes:
    """Per-process registry of asyncio waiters by job id; `changed` may be called from any
    thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, dict[asyncio.Future[None], asyncio.AbstractEventLoop]] = (
            defaultdict(dict)
        )

    def subscribe(self, job_id: str) -> asyncio.Future[None]:
        """A future resolved at the job's next change; call before reading the job, so a change
        between the read and the wait is not missed. Pair with `unsubscribe`."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._waiters[job_id][future] = loop
        return future

    def unsubscribe(self, job_id: str, future: asyncio.Future[None]) -> None:
        with self._lock:
            waiting = self._waiters.get(job_id)
            if waiting is None:
                return
            waiting.pop(future, None)
            if not waiting:
                del self._waiters[job_id]

    def waiting(self, job_id: str) -> int:
        """How many wait for the job's next change now."""
        with self._lock:
            return len(self._waiters.get(job_id, ()))

    def changed(self, job_id: str) -> None:
        with self._lock:
            waiting = self._waiters.pop(job_id, {})
        for future, loop in waiting.items():
            loop.call_soon_threadsafe(_resolve, future)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


CHANGES = Changes()


def touched(session: Session, job_id: str) -> None:
    """Mark `job_id` as changed by this session's transaction (woken at its commit); one
    NOTIFY per job and transaction, however many writes touch it."""
    changed = session.info.setdefault("changed_jobs", set())
    if job_id in changed:
        return
    changed.add(job_id)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(
            text("SELECT pg_notify(:channel, :job)"), {"channel": CHANNEL, "job": job_id}
        )


@event.listens_for(Session, "after_commit")
def _after_commit(session: Session) -> None:
    for job_id in session.info.pop("changed_jobs", ()):
        CHANGES.changed(job_id)


@event.listens_for(Session, "after_rollback")
def _after_rollback(session: Session) -> None:
    session.info.pop("changed_jobs", None)


class Listener:
    """LISTEN layerswap_jobs on its own PostgreSQL connection, in a thread; reconnects after a
    lost connection (waiters time out and re-read meanwhile)."""

    def __init__(self, url: str) -> None:
        self.url = url.replace("postgresql+psycopg://", "postgresql://", 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layerswap-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self.url, autocommit=True) as connection:
                    connection.execute(f"LISTEN {CHANNEL}")
                    while not self._stop.is_set():
                        for note in connection.notifies(timeout=1.0):
                            CHANGES.changed(note.payload)
            except Exception as e:  # boundary: the listener thread lives on
                log.warning("LISTEN %s lost (%s); reconnecting", CHANNEL, e)
                self._stop.wait(1.0)
