"""Every list route reads its page from an index, in order: the statements the routes really
send (captured from the engine) are explained by SQLite's planner, which must search an index
by the tenant (or job) and never sort the rows in a temporary b-tree."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from sqlalchemy import event

from tests.service.conftest import layer_swap, running_service

LISTED = ("jobs", "sweeps", "webhook_deliveries", "job_events")


def test_list_routes_search_an_index_in_order(tmp_path: Path, examples: Path) -> None:
    with running_service(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples) as service:
        job = service.submit(layer_swap())
        assert service.wait(job["id"])["status"] == "succeeded"
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


def test_the_migrated_indexes_are_the_models(tmp_path: Path) -> None:
    """Migration 0007 makes exactly the indexes the models declare."""
    from sqlalchemy import create_engine, inspect

    from service.db.migrate import upgrade
    from service.db.models import Base

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
