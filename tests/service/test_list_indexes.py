"""Every list route reads its page from an index, in order: the statements the routes really
send (captured from the engine, and from the sqlite3 connections for pages read through the
driver itself, core/job_rows.py) are explained by SQLite's planner, which must search an
index by the tenant (or job) and never sort the rows in a temporary b-tree; a page after a
cursor starts the search at the cursor. On PostgreSQL, the job pages' statements as
job_rows.fetch sends them are explained likewise."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sqlalchemy import event

from core.job_rows import driver_statement
from core.jobs import page_query
from tests.service.conftest import layer_swap, running_service

LISTED = ("jobs", "sweeps", "webhook_deliveries", "job_events")


def test_list_routes_search_an_index_in_order(tmp_path: Path, examples: Path) -> None:
    with running_service(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples) as service:
        job = service.submit(layer_swap())
        assert service.wait(job["id"])["status"] == "succeeded"
        service.wait(service.submit(layer_swap())["id"])  # two: a first page has a cursor
        page = service.client.get("/v1/merges", params={"limit": 1}).json()
        statements: list[tuple[str, Any]] = []

        def capture(conn: Any, cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
            # a route's page (by tenant) or a job's events; not the reconciler's own reads
            routed = "tenant_id = " in statement or "FROM job_events" in statement
            if (
                statement.lstrip().upper().startswith("SELECT")
                and "ORDER BY" in statement
                and routed
            ):
                statements.append((statement, parameters))

        def trace(connection: Any, _record: Any) -> None:  # SQL as run, values in place
            connection.set_trace_callback(lambda sql: capture(None, None, sql, ()))

        # Connections are made anew, traced: the pool's, and the event loop's own for pages
        # of merges (service/api/row_reads.py).
        rows = service.client.app.state.context.rows  # type: ignore[attr-defined]
        engines = (service.db.engine, rows.engine)
        for engine in engines:
            engine.dispose()
            event.listen(engine, "connect", trace)
        rows.dispose()
        event.listen(service.db.engine, "before_cursor_execute", capture)
        routes = [
            "/v1/merges",
            "/v1/merges?status=succeeded",
            f"/v1/merges?limit=1&cursor={page['next_cursor'] or ''}",
            "/v1/evaluations?status=queued",
            "/v1/sweeps",
            "/v1/webhooks/deliveries?status=failed",
            f"/v1/merges/{job['id']}/events",
        ]
        for route in routes:
            response = service.client.get(route)
            assert response.status_code == 200, (route, response.text)
        event.remove(service.db.engine, "before_cursor_execute", capture)
        for engine in engines:
            event.remove(engine, "connect", trace)
        rows.dispose()
        service.db.engine.dispose()

        explained: dict[str, tuple[str, list[str]]] = {}
        with service.db.engine.connect() as connection:
            for statement, parameters in statements:
                table = re.search(r"\bFROM (\w+)", statement)
                if table is None or table.group(1) not in LISTED:
                    continue
                plan = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
                explained[statement] = (table.group(1), [row[-1] for row in plan])
    assert {table for table, _ in explained.values()} == set(LISTED)  # every list route seen
    for statement, (name, details) in explained.items():
        searched = [d for d in details if re.match(rf"SEARCH {name} USING (COVERING )?INDEX", d)]
        assert searched, (statement, details)
        assert not [d for d in details if "TEMP B-TREE" in d], (statement, details)
        if "(jobs.created_at, jobs.id) <" in statement:  # a page after a cursor starts there
            assert "(created_at,id)<(?,?)" in searched[0], (statement, details)
    assert any("(jobs.created_at, jobs.id) <" in statement for statement in explained)
    assert any("FROM jobs" in statement and "'merge'" in statement for statement in explained)


def test_the_migrated_indexes_are_the_models(tmp_path: Path) -> None:
    """Migration 0007 makes exactly the indexes the models declare."""
    from sqlalchemy import create_engine, inspect

    from core.db.migrate import upgrade
    from core.db.models import Base

    url = f"sqlite:///{tmp_path / 'db.sqlite'}"
    upgrade(url)
    engine = create_engine(url)
    try:
        found = inspect(engine)
        for table in LISTED:
            migrated = {i["name"]: i["column_names"] for i in found.get_indexes(table)}
            declared = {
                str(i.name): [c.name for c in i.columns]
                for i in Base.metadata.tables[table].indexes
            }
            assert declared.items() <= migrated.items(), (table, declared, migrated)
    finally:
        engine.dispose()


def test_merge_pages_are_read_from_an_index_in_order_on_postgres(
    tmp_path: Path, postgres_url: str, examples: Path
) -> None:
    """PostgreSQL's planner, with sequential scans priced out (a test table is too small for
    its costs to prefer an index), reads each page of GET /v1/merges backwards along one of
    the jobs indexes, the cursor's (created_at, id) a bound of the scan, and never sorts. The
    statements are the ones job_rows.fetch sends for the route's pages (compiled once)."""
    with running_service(tmp_path, postgres_url, examples) as service:
        job = service.submit(layer_swap())
        assert service.wait(job["id"])["status"] == "succeeded"
        service.wait(service.submit(layer_swap())["id"])
        cursor = service.client.get("/v1/merges", params={"limit": 1}).json()["next_cursor"]
        assert cursor
        with service.db.engine.connect() as connection:
            connection.exec_driver_sql("SET enable_seqscan = off")
            for status, after in [(None, None), ("succeeded", None), (None, cursor),
                                  ("succeeded", cursor)]:  # fmt: skip
                page = page_query(tenant="default", kind="merge", status=status,
                                  artifact=None, cursor=after, limit=50)  # fmt: skip
                assert page is not None
                sql, values = driver_statement(page[0], service.db.engine.dialect, page[1])
                explained = connection.exec_driver_sql(f"EXPLAIN {sql}", values)
                plan = "\n".join(row[0] for row in explained)
                assert re.search(r"Index Scan Backward using ix_jobs_tenant_kind_\w+ on jobs", plan)
                assert "Sort" not in plan, plan
                if after:  # where the scan starts, not a filter
                    assert re.search(r"Index Cond: .*ROW\(created_at", plan), plan
