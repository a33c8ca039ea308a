"""The PostgreSQL pool pings a connection that sat idle before handing it out, so one whose
server process went away meanwhile is replaced, not handed to a request."""

from __future__ import annotations

import time

from sqlalchemy import create_engine, text

from core.db.session import IDLE_PING_S, make_engine
from tests.service.conftest import POSTGRES_ADMIN


def test_an_idle_connection_that_died_is_replaced_at_checkout(postgres_url: str) -> None:
    engine = make_engine(postgres_url)
    admin = create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            first = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        with admin.connect() as connection:  # the server ends that connection's process
            connection.execute(text("SELECT pg_terminate_backend(:pid)"), {"pid": first})
        time.sleep(IDLE_PING_S + 0.2)  # idle long enough to be pinged at the next checkout
        with engine.connect() as connection:
            second = connection.execute(text("SELECT pg_backend_pid()")).scalar_one()
        assert second != first
        assert engine.pool.checkedout() == 0
    finally:
        engine.dispose()
        admin.dispose()
