"""Reading job rows for GET answers (service/api/answers.py), the cheapest way each database
allows.

SQLite: on the event loop's thread, on a connection of its own, through the sqlite3 module
itself: a keyed read takes ~0.1 ms and a WAL reader does not wait for the writer, while a hop
to a thread and back costs more than the read (GIL hand-offs: 522 polls/s through the threads
against 873 inline, on 2 cores). The row is the driver's (JSON and datetimes as text), which
compares as cheaply as it reads; SQLAlchemy's conversions are made only when an answer is
made from it (polling.answer_for); through SQLAlchemy the same read cost 140-220 µs of CPU
against 20-35 µs (in-process). If SQLite is busy all the same, that read is made on a thread,
where waiting holds up no one else.

PostgreSQL: in batches. The rows asked for while a batch is out are read together in the next
one (`WHERE id = ANY(...)`, on a thread, in autocommit: job_rows.fetch), so
200 pollers cost one round trip and one thread hop per batch, not one each. A batch
starts after every request in it arrived, so each answer still shows every change committed
before its request came."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Collection, Sequence
from typing import Any

from anyio import to_thread
from sqlalchemy import Select, create_engine
from sqlalchemy.exc import DBAPIError
from sqlalchemy.pool import PoolProxiedConnection, StaticPool

from core.db.session import Database
from core.job_rows import ID, MANY, ONE, driver_select, driver_statement, fetch

BATCH_ROWS = 200  # at most this many ids per SELECT
BATCHES_OUT = 2  # batches read at once: one fills while the other is out


class LoopRows:
    """SQLite: rows read on the event loop's thread, on one connection used by that thread
    alone, which gives up at once when the database is locked; that read is then made on a
    thread, on the Database's pool (whose connections wait for the lock)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.engine = create_engine(
            db.url, poolclass=StaticPool, connect_args={"check_same_thread": False, "timeout": 0}
        )
        self.statement = driver_select(self.engine.dialect)
        self._held: PoolProxiedConnection | None = None  # the engine's one, checked out for good
        self._connection: sqlite3.Connection | None = None  # the sqlite3 one it wraps

    async def read(self, job_id: str) -> Sequence[Any] | None:
        """The job's row as the driver hands it back; None when there is no such job."""
        try:
            # fetchall: the statement runs to its end, so no read snapshot is left open
            found = self._connected().execute(self.statement, (job_id,)).fetchall()
            return found[0] if found else None
        except sqlite3.Error as e:
            self._unless_busy(e)
        return await to_thread.run_sync(self._read_waiting, job_id)

    def _read_waiting(self, job_id: str) -> Sequence[Any] | None:
        found = fetch(self.db, ONE, {"job_id": job_id})
        return found[0] if found else None

    async def page(
        self, query: Select[*tuple[Any, ...]], params: dict[str, Any]
    ) -> list[Sequence[Any]]:
        """A page's rows (core/jobs.py, page_query), read as `read` reads a row: ~0.5 ms on
        the loop for 50 jobs, against ~1 ms more of GIL hand-offs through a thread."""
        try:
            connection = self._connected()
            sql, values = driver_statement(query, self.engine.dialect, params)
            found: list[Sequence[Any]] = connection.execute(sql, values).fetchall()
            return found
        except sqlite3.Error as e:
            self._unless_busy(e)
        return await to_thread.run_sync(fetch, self.db, query, params)

    def _unless_busy(self, e: sqlite3.Error) -> None:
        """Raise `e` as SQLAlchemy would have (a DBAPIError), unless the database was only
        locked or busy: then the caller reads on a thread, waiting."""
        if isinstance(e, sqlite3.OperationalError) and ("locked" in str(e) or "busy" in str(e)):
            return
        dialect = self.engine.dialect
        raise DBAPIError.instance(None, None, e, sqlite3.Error, dialect=dialect) from e

    def _connected(self) -> sqlite3.Connection:
        if self._connection is None:
            self._held = self.engine.raw_connection()
            self._connection = self._held.driver_connection
        assert self._connection is not None
        return self._connection

    def dispose(self) -> None:
        held, self._held, self._connection = self._held, None, None
        if held is not None:
            held.close()
        self.engine.dispose()


class BatchedRows:
    """PostgreSQL: rows read in batches on threads (BATCHES_OUT at most); for one event loop."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.selects = 0  # made so far (each read by a batch)
        self._waiting: list[tuple[str, asyncio.Future[Sequence[Any] | None]]] = []
        self._out: set[asyncio.Task[None]] = set()  # held here: the loop keeps weak references

    async def read(self, job_id: str) -> Sequence[Any] | None:
        """The job's row as the driver hands it back (core/job_rows.py), read after this
        call began; None when there is no such job."""
        future: asyncio.Future[Sequence[Any] | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((job_id, future))
        if len(self._out) < BATCHES_OUT:
            self._out.add(asyncio.get_running_loop().create_task(self._read_batches()))
        return await future

    async def _read_batches(self) -> None:
        try:
            while self._waiting:
                batch = self._waiting[:BATCH_ROWS]
                del self._waiting[:BATCH_ROWS]
                try:
                    rows = await to_thread.run_sync(self._read, {job_id for job_id, _ in batch})
                except Exception as e:  # boundary: each waiter gets it, as from a lone read
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for job_id, future in batch:
                    if not future.done():  # not when its request was given up meanwhile
                        future.set_result(rows.get(job_id))
        finally:  # at once, with no await since the loop's test: a read after it starts a task
            self._out.discard(asyncio.current_task())  # type: ignore[arg-type]

    async def page(
        self, query: Select[*tuple[Any, ...]], params: dict[str, Any]
    ) -> list[Sequence[Any]]:
        """A page's rows (core/jobs.py, page_query), read on a thread."""
        return await to_thread.run_sync(fetch, self.db, query, params)

    def _read(self, job_ids: Collection[str]) -> dict[str, Sequence[Any]]:
        self.selects += 1
        return {row[ID]: row for row in fetch(self.db, MANY, {"job_ids": list(job_ids)})}

    def dispose(self) -> None:
        """Nothing of its own: it reads on the Database's pool."""
