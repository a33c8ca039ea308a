"""GET /v1/merges pages by keyset (created_at, id), on SQLite and PostgreSQL: walking the
cursors covers every merge that existed when the walk began exactly once, newest first, while
merges are added between pages (newer ones, and one older than the cursor as a clock behind
another process's would make); ties on created_at (whole seconds too) are broken by id; other
tenants' jobs and other kinds never appear. Each item is the merge as GET /v1/merges/{id}
answers it. (That the pages are read from an index in order: test_list_indexes.py.)"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import insert

from core.db.models import Job, Tenant
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor

START = datetime(2026, 11, 20, 12, 0, 0, tzinfo=UTC)


@pytest.fixture
def held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as running:
        yield running


def add_jobs(service: Service, specs: list[tuple[datetime, str, str, str]]) -> list[str]:
    """Jobs as (created_at, tenant, kind, status), inserted as they are: their ids."""
    rows: list[dict[str, Any]] = []
    for created, tenant, kind, status in specs:
        job_id = uuid.uuid4().hex
        rows.append({
            "id": job_id, "tenant_id": tenant, "kind": kind, "status": status,
            "request": layer_swap(), "request_hash": "0" * 64, "output_name": f"o-{job_id}",
            "max_attempts": 3, "created_at": created,
        })  # fmt: skip
    with service.db.session() as session:
        for tenant in {row["tenant_id"] for row in rows}:
            if session.get(Tenant, tenant) is None:
                session.add(Tenant(id=tenant))
        session.flush()
        session.execute(insert(Job), rows)
    return [row["id"] for row in rows]


def walk(service: Service, query: str, between: list[list[tuple[datetime, str, str, str]]]) -> \
        tuple[list[dict[str, Any]], list[list[str]]]:  # fmt: skip
    """Every page of `GET /v1/merges?<query>`, adding between[i]'s jobs after page i."""
    items: list[dict[str, Any]] = []
    added: list[list[str]] = []
    cursor, page = "", 0
    while True:
        url = f"/v1/merges?{query}" + (f"&cursor={cursor}" if cursor else "")
        response = service.client.get(url)
        assert response.status_code == 200, response.text
        items += response.json()["items"]
        cursor = response.json()["next_cursor"] or ""
        if not cursor:
            return items, added
        if page < len(between):
            added.append(add_jobs(service, between[page]))
        page += 1


def test_pages_cover_every_merge_once_in_order_while_merges_are_added(held: Service) -> None:
    # 60 merges on 12 instants, 5 sharing each (every third instant a whole second), mixed
    # with another tenant's merges and this tenant's analyses at the same instants.
    instants = [START + timedelta(seconds=i, microseconds=0 if i % 3 == 0 else 1000 * i)
                for i in range(12)]  # fmt: skip
    specs = [(at, "default", "merge", "queued" if n % 2 else "succeeded")
             for at in instants for n in range(5)]  # fmt: skip
    mine = add_jobs(held, specs)
    add_jobs(held, [(at, "other", "merge", "queued") for at in instants])
    add_jobs(held, [(at, "default", "analysis", "queued") for at in instants])
    created = {job_id: spec[0] for job_id, spec in zip(mine, specs, strict=True)}
    newest_first = sorted(mine, key=lambda j: (created[j], j), reverse=True)

    now = datetime.now(UTC)
    between = [
        [(now, "default", "merge", "queued")] * 3,  # newer than every page: never shown later
        [(instants[4], "default", "merge", "queued")],  # behind the cursor: shown at most once
        [(now + timedelta(seconds=1), "default", "merge", "succeeded")],
    ]
    items, added = walk(held, "limit=7", between)
    ids = [item["id"] for item in items]
    assert [i for i in ids if i in created] == newest_first  # everyone once, in order
    assert not set(ids) & set(added[0] + added[2])  # the newer ones sort before the cursor
    assert [i for i in ids if i in added[1]] == added[1]  # behind it: once, in its place
    created[added[1][0]] = instants[4]
    assert [(created[i], i) for i in ids] == sorted(((created[i], i) for i in ids), reverse=True)
    by_id = {item["id"]: item for item in items}
    for job_id in newest_first[:3]:
        assert by_id[job_id] == held.client.get(f"/v1/merges/{job_id}").json()

    # the same walk of one status, over the merges of that status then
    items, _ = walk(held, "status=succeeded&limit=4", [])
    succeeded = [j for j in newest_first if specs[mine.index(j)][3] == "succeeded"]
    assert [item["id"] for item in items] == [*added[2], *succeeded]


def test_a_cursor_from_elsewhere_is_refused(held: Service) -> None:
    for cursor in ("not-base64!", "bm90IGpzb24=", "WyJ4IiwgIngiXQ=="):
        response = held.client.get(f"/v1/merges?cursor={cursor}")
        assert response.status_code == 422, (cursor, response.text)
        assert response.json()["error"]["details"]["field"] == "cursor"


def test_a_page_reads_the_same_whichever_way_its_query_is_read(held: Service) -> None:
    """A walk asking only `limit` and `cursor` is answered without FastAPI's parameter solving
    (service/api/lean.py); any other query goes through it. Both give the same pages, and
    FastAPI still refuses what it refused."""
    add_jobs(held, [(START + timedelta(seconds=i), "default", "merge", "queued") for i in range(7)])
    plain = held.client.get("/v1/merges?limit=3").json()
    solved = held.client.get("/v1/merges?limit=3&input_artifact=").json()
    assert plain == solved and len(plain["items"]) == 3
    cursor = plain["next_cursor"]
    assert (
        held.client.get(f"/v1/merges?cursor={cursor}&limit=3").json()
        == held.client.get(f"/v1/merges?limit=3&cursor={cursor}&output_artifact=").json()
    )
    assert held.client.get("/v1/merges?limit=50").json() == held.client.get("/v1/merges").json()
    for query in ("limit=3.0", "limit=03", "limit=+3"):  # read by FastAPI: pydantic's 3
        assert held.client.get(f"/v1/merges?{query}").json() == plain, query
    for query in ("limit=0", "limit=201", "limit=x", "limit="):
        refused = held.client.get(f"/v1/merges?{query}")
        assert refused.status_code == 422, (query, refused.text)
        assert refused.json()["error"]["details"]["field"] == "limit", refused.text
