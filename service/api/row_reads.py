"""Reading job rows for GET answers (service/api/answers.py), the cheapest way each database
allows.

SQLite: on the event loop's thread, on a connection of its own. A keyed read takes ~0.1 ms and
a WAL reader does not wait for the writer, while a hop to a thread and back costs more than the
read (GIL hand-offs: 522 polls/s through the threads against 873 inline, on 2 cores). If SQLite
is busy all the same, that read is made on a thread, where waiting holds up no one else.

PostgreSQL: in batches. The rows asked for while a batch is out are read together in the next
one (`WHERE id = ANY(...)`, on a thread, in autocommit: a lone SELECT needs no transaction), so
200 pollers cost one round trip and one thread hop per batch, not one each. A batch
starts after every request in it arrived, so each answer still shows every change committed
before its request came."""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from typing import Any

from anyio import to_thread
from sqlalchemy import Row, create_engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.pool import StaticPool

from service.db.session import Database
from service.job_rows import read_row, read_rows

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

    async def read(self, job_id: str) -> Row[Any] | None:
        """The job's row; None when there is no such job."""
        try:
            with self.engine.connect() as connection:
                return read_row(connection, job_id)
        except OperationalError as e:
            if "locked" not in str(e) and "busy" not in str(e):
                raise
        return await to_thread.run_sync(self._read_waiting, job_id)

    def _read_waiting(self, job_id: str) -> Row[Any] | None:
        with self.db.engine.connect() as connection:
            return read_row(connection, job_id)

    def dispose(self) -> None:
        self.engine.dispose()


class BatchedRows:
    """PostgreSQL: rows read in batches on threads (BATCHES_OUT at most); for one event loop."""

    def __init__(self, db: Database) -> None:
        self.engine = db.engine.execution_options(isolation_level="AUTOCOMMIT")
        self._waiting: list[tuple[str, asyncio.Future[Row[Any] | None]]] = []
        self._out: set[asyncio.Task[None]] = set()  # held here: the loop keeps weak references

    async def read(self, job_id: str) -> Row[Any] | None:
        """The job's row, read after this call began; None when there is no such job."""
        future: asyncio.Future[Row[Any] | None] = asyncio.get_running_loop().create_future()
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
                except Exception as e:  # each request fails as a lone read would have
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(e)
                    continue
                for job_id, future in batch:
                    if not future.done():  # not when its request was given up meanwhile
                        future.set_result(rows.get(job_id))
        finally:  # at once, with no await since the loop's test: a read after it starts a task
            self._out.discard(asyncio.current_task())  # type: ignore[arg-type]

    def _read(self, job_ids: Collection[str]) -> dict[str, Row[Any]]:
        with self.engine.connect() as connection:
            return {row.id: row for row in read_rows(connection, job_ids)}

    def dispose(self) -> None:
        """Nothing of its own: it reads on the Database's pool."""
