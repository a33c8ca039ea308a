"""Engines and sessions. Background code never manages sessions by hand: `db.session()` owns
commit, rollback and close."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from sqlalchemy import Dialect, Engine, create_engine, event
from sqlalchemy.exc import DBAPIError, DisconnectionError
from sqlalchemy.orm import Session, sessionmaker

# As many pooled connections as the API has request threads (AnyIO's 40): a smaller pool
# closes and reopens its overflow connections under load (measured on PostgreSQL: ~70 per
# second; on SQLite, opening one and setting its pragmas was a third of a poll's cost).
POOL_SIZE, MAX_OVERFLOW = 40, 10
IDLE_PING_S = 1.0


def make_engine(url: str) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(
            url,
            connect_args={"check_same_thread": False, "timeout": 30},
            pool_size=POOL_SIZE,
            max_overflow=MAX_OVERFLOW,
        )
        event.listen(engine, "connect", _sqlite_pragmas)
        return engine
    engine = create_engine(url, pool_size=POOL_SIZE, max_overflow=MAX_OVERFLOW)
    event.listen(engine, "checkin", _checked_in)
    event.listen(engine, "checkout", partial(_ping_if_idle, engine.dialect))
    return engine


def _sqlite_pragmas(connection: Any, _record: Any) -> None:
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")  # readers never block the writer
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute("PRAGMA busy_timeout=30000")
    cursor.close()


def _checked_in(_connection: Any, record: Any) -> None:
    record.info["checked_in"] = time.monotonic()


def _ping_if_idle(dialect: Dialect, connection: Any, record: Any, _proxy: Any) -> None:
    """pool_pre_ping, only for a connection that sat in the pool IDLE_PING_S or more: one back
    sooner was just used, and under load every connection is, so a ping per checkout (one more
    round trip per request) would mostly ask what was just answered. A dead one is replaced
    (DisconnectionError makes the pool connect anew, as pre_ping does); one that died in the
    last IDLE_PING_S fails its request (a 503), which renews all the pool's connections."""
    if time.monotonic() - record.info.get("checked_in", -IDLE_PING_S) < IDLE_PING_S:
        return
    try:
        alive = dialect.do_ping(connection)
    except dialect.loaded_dbapi.Error as e:  # what SQLAlchemy's own pre-ping catches
        raise DisconnectionError(f"pooled connection is dead: {e}") from e
    if not alive:
        raise DisconnectionError("pooled connection is dead")


class Database:
    def __init__(self, url: str) -> None:
        self.url = url
        self.engine = make_engine(url)
        self._sessions = sessionmaker(self.engine, expire_on_commit=False)

    @property
    def is_sqlite(self) -> bool:
        return self.url.startswith("sqlite")

    @contextmanager
    def session(self) -> Iterator[Session]:
        session = self._sessions()
        try:
            yield session
            session.commit()
        except BaseException:  # cleanup and re-raise, cancellations and exits included
            session.rollback()
            raise
        finally:
            session.close()

    @contextmanager
    def driver_cursor(self) -> Iterator[Any]:
        """A cursor of the driver itself, on a connection of the pool, for reads whose
        SQLAlchemy execution costs more than the read (a job's row, a page of rows); on
        PostgreSQL in autocommit (a lone SELECT needs no transaction: no BEGIN and ROLLBACK
        round trips). The driver's errors are raised as SQLAlchemy's execution raises them
        (DBAPIError: the API answers an unreachable database with a 503), and a connection they
        show dead leaves the pool."""
        options = {} if self.is_sqlite else {"isolation_level": "AUTOCOMMIT"}
        dialect = self.engine.dialect
        with self.engine.connect().execution_options(**options) as connection:
            driver = connection.connection.dbapi_connection
            assert driver is not None
            cursor = driver.cursor()
            try:
                yield cursor
            except dialect.loaded_dbapi.Error as e:
                dead = dialect.is_disconnect(e, driver, cursor)
                if dead:
                    connection.invalidate(e)
                raise DBAPIError.instance(
                    None, None, e, dialect.loaded_dbapi.Error,
                    connection_invalidated=dead, dialect=dialect,
                ) from e  # fmt: skip
            finally:
                cursor.close()

    def dispose(self) -> None:
        self.engine.dispose()
