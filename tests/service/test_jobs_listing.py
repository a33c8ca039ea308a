"""GET /v1/jobs: merges, evaluations, analyses and sweeps in one list, newest first; filters by
kind, status and text; keyset pages that never repeat or skip a job; bad queries refused; each
tenant sees its own (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.api.jobs import COLLECTION
from service.auth import create_key
from tests.evaluation.test_api import EVALUATION
from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor


@pytest.fixture
def held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """Jobs stay queued: listing needs no worker."""
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as s:
        yield s


def post(service: Service, path: str, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = service.client.post(path, json=body, headers=headers)
    assert response.status_code == 202, response.text
    return dict(response.json())


def listed(service: Service, **params: Any) -> dict[str, Any]:
    response = service.client.get("/v1/jobs", params=params)
    assert response.status_code == 200, response.text
    return dict(response.json())


def seed(service: Service) -> list[tuple[str, str]]:
    """(kind, id) of every job and sweep submitted (a sweep's own jobs included)."""
    made = []
    for i in range(3):
        body = {**layer_swap(), "output": {"name": f"m{i}"}}
        made.append(("merge", post(service, "/v1/merges", body)["id"]))
    evaluation = {"source": "math", "evaluation": EVALUATION}
    made.append(("evaluation", post(service, "/v1/evaluations", evaluation)["id"]))
    analysis = {"base": "base", "experts": [{"label": "math", "path": "math"}]}
    made.append(("analysis", post(service, "/v1/analyses", analysis)["id"]))
    sweep = {"task_experts": ["math"], "language_experts": ["swh"], "base": "base",
             "configurations": [{"bottom": 1, "top": 1}], "evaluation": EVALUATION,
             "objective": {"task": EVALUATION["tasks"][0]}}  # fmt: skip
    sweep_id = post(service, "/v1/sweeps", sweep)["id"]
    made.append(("sweep", sweep_id))
    everything = listed(service, limit=200)["items"]
    return made + [(j["kind"], j["id"]) for j in everything if j["sweep_id"] == sweep_id]


def test_every_kind_in_one_list_newest_first_with_filters(held: Service) -> None:
    made = seed(held)
    items = listed(held, limit=200)["items"]
    assert {(j["kind"], j["id"]) for j in items} == set(made)
    order = [(j["created_at"], j["id"]) for j in items]
    assert order == sorted(order, reverse=True)
    by_id = {j["id"]: j for j in items}
    sweep_id = next(i for k, i in made if k == "sweep")
    assert by_id[sweep_id]["progress"]["unit"] == "jobs" and by_id[sweep_id]["name"] is None
    assert by_id[sweep_id]["progress"]["total"] == sum(
        1 for j in items if j["sweep_id"] == sweep_id
    )
    for job in items:
        assert job["url"] == f"/v1/{COLLECTION[job['kind']]}/{job['id']}"
        assert held.client.get(job["url"]).json()["status"] == job["status"]

    for kind in ("merge", "evaluation", "analysis", "sweep"):
        assert [j["id"] for j in listed(held, kind=kind)["items"]] == [
            j["id"] for j in items if j["kind"] == kind
        ]
    assert [j["id"] for j in listed(held, q="M1")["items"]] == [
        j["id"] for j in items if j["name"] == "m1"
    ]
    assert [j["id"] for j in listed(held, q=sweep_id[:10])["items"]] == [sweep_id]
    assert listed(held, q="%")["items"] == [], "LIKE wildcards are matched as text"
    assert [j["id"] for j in listed(held, status="queued", kind="merge")["items"]] == [
        j["id"] for j in items if j["kind"] == "merge"
    ]
    assert listed(held, status="succeeded")["items"] == []


def test_pages_follow_the_cursor_without_repeats_or_gaps(held: Service) -> None:
    made = seed(held)
    seen: list[str] = []
    cursor = None
    while True:
        page = listed(held, limit=3, **({"cursor": cursor} if cursor else {}))
        assert len(page["items"]) <= 3
        seen += [j["id"] for j in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == [j["id"] for j in listed(held, limit=200)["items"]]
    assert sorted(seen) == sorted(i for _, i in made)


@pytest.mark.parametrize(
    ("query", "field"),
    [({"kind": "pipeline"}, "kind"), ({"status": "done"}, "status"), ({"limit": 0}, "limit"),
     ({"limit": 201}, "limit"), ({"cursor": "not-a-cursor"}, "cursor"), ({"q": "x" * 201}, "q")],
)  # fmt: skip
def test_bad_queries_are_refused_naming_the_field(
    held: Service, query: dict[str, Any], field: str
) -> None:
    response = held.client.get("/v1/jobs", params=query)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["details"]["field"] == field


def test_a_tenant_lists_its_own_jobs_only(tmp_path: Path, examples: Path) -> None:
    url = f"sqlite:///{tmp_path / 'layerswap.db'}"
    with running_service(tmp_path, url, examples, auth=True, job_executor=HeldExecutor()) as s:
        keys = {t: create_key(s.db, t) for t in ("alice", "bob")}
        mine = {t: post(s, "/v1/merges", layer_swap(), Authorization=f"Bearer {k}")["id"]
                for t, k in keys.items()}  # fmt: skip
        for tenant, key in keys.items():
            response = s.client.get("/v1/jobs", headers={"Authorization": f"Bearer {key}"})
            assert [j["id"] for j in response.json()["items"]] == [mine[tenant]]
        assert s.client.get("/v1/jobs").status_code == 401
        assert s.client.get("/ui/").status_code == 200, "the console's files need no key"
