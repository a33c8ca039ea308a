"""GET /v1/jobs: `total` counts every job the filters match (on every page); `before` pages
back to exactly the page before; `sort` and `order` order by created time, kind, name, status,
method or duration either way, and pages in that order never repeat or skip a job; a bad sort
or a cursor of another sort is refused naming the field (SQLite and PostgreSQL)."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from core.db.models import Job
from service.api.jobs import NOT_ENDED, SORTS
from tests.evaluation.conftest import TASK
from tests.service.conftest import Service, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from tests.service.test_jobs_listing import listed, seed

# Run times (seconds) given to the first merges, as a worker would record them.
RUN_TIMES = (30.0, 5.5, 120.25)


@pytest.fixture
def held(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """Jobs stay queued until a test says they ran (`timed`)."""
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as s:
        yield s


def walk(service: Service, limit: int, **params: Any) -> list[dict[str, Any]]:
    """Every item, a page at a time along next_cursor; checks `total` on each page."""
    found: list[dict[str, Any]] = []
    total = listed(service, limit=200, **params)["total"]
    cursor = None
    while True:
        page = listed(service, limit=limit, **params, **({"cursor": cursor} if cursor else {}))
        assert page["total"] == total and len(page["items"]) <= limit
        found += page["items"]
        cursor = page["next_cursor"]
        if cursor is None:
            return found


def timed(service: Service) -> None:
    """The first merges ran for RUN_TIMES; the rest have not ended."""
    with service.db.session() as session:
        merges = session.scalars(select(Job).where(Job.kind == "merge").order_by(Job.id)).all()
        for job, seconds in zip(merges, RUN_TIMES, strict=False):
            job.status = "succeeded"
            job.started_at = job.created_at + timedelta(seconds=1)
            job.finished_at = job.started_at + timedelta(seconds=seconds)


def sort_key(sort: str, item: dict[str, Any]) -> tuple[Any, ...]:
    tie = (item["created_at"], item["id"])
    if sort == "created_at":
        return tie
    if sort == "duration":
        return (NOT_ENDED if item["duration_s"] is None else item["duration_s"], *tie)
    return (item[sort] or "", *tie)


def test_total_counts_the_filtered_list_and_before_pages_back(held: Service) -> None:
    made = seed(held)
    everything = listed(held, limit=200)
    assert everything["total"] == len(made) == len(everything["items"])
    assert everything["prev_cursor"] is None and everything["next_cursor"] is None
    for kind in ("merge", "evaluation", "analysis", "sweep"):
        assert listed(held, kind=kind, limit=1)["total"] == sum(1 for k, _ in made if k == kind)
    assert listed(held, status="succeeded")["total"] == 0
    assert listed(held, q="m1")["total"] == 1

    first = listed(held, limit=3)
    second = listed(held, limit=3, cursor=first["next_cursor"])
    third = listed(held, limit=3, cursor=second["next_cursor"])
    assert first["prev_cursor"] is None and second["prev_cursor"] and third["items"]
    back = listed(held, limit=3, before=third["prev_cursor"])
    assert back["items"] == second["items"]
    assert back["next_cursor"] == second["next_cursor"]
    again = listed(held, limit=3, before=back["prev_cursor"])
    assert again["items"] == first["items"] and again["prev_cursor"] is None
    assert again["total"] == back["total"] == len(made)


def test_items_say_their_method_and_duration(held: Service) -> None:
    seed(held)
    timed(held)
    items = listed(held, limit=200)["items"]
    methods = {j["kind"]: j["method"] for j in items if j["sweep_id"] is None}
    assert methods == {
        "merge": "layer_swap",
        "evaluation": TASK,
        "analysis": "base",
        "sweep": TASK,
    }
    durations = sorted(j["duration_s"] for j in items if j["duration_s"] is not None)
    assert durations == sorted(RUN_TIMES)
    for job in items:
        if job["duration_s"] is None:
            assert job["finished_at"] is None
        else:
            assert job["started_at"] < job["finished_at"] and job["status"] == "succeeded"


@pytest.mark.parametrize("sort", SORTS)
def test_each_sort_pages_in_order_both_ways(held: Service, sort: str) -> None:
    made = seed(held)
    timed(held)
    for order in ("asc", "desc"):
        items = walk(held, 2, sort=sort, order=order)
        assert sorted(j["id"] for j in items) == sorted(i for _, i in made)
        keys = [sort_key(sort, j) for j in items]
        assert keys == sorted(keys, reverse=order == "desc"), (sort, order)
        first = listed(held, limit=2, sort=sort, order=order)
        second = listed(held, limit=2, sort=sort, order=order, cursor=first["next_cursor"])
        assert (
            listed(held, limit=2, sort=sort, order=order, before=second["prev_cursor"])["items"]
            == first["items"]
        )


@pytest.mark.parametrize(
    ("query", "field", "words"),
    [({"sort": "owner"}, "sort", "sort"), ({"order": "up"}, "order", "order"),
     ({"sort": "status", "cursor": "eyJhIjogMX0="}, "cursor", "cursor"),
     ({"sort": "status", "before": "x"}, "before", "before")],
)  # fmt: skip
def test_bad_sorts_are_refused_naming_the_field(
    held: Service, query: dict[str, Any], field: str, words: str
) -> None:
    response = held.client.get("/v1/jobs", params=query)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["details"]["field"] == field and words in error["message"], error


def test_a_cursor_is_read_with_the_sort_it_was_made_for(held: Service) -> None:
    seed(held)
    by_status = listed(held, limit=2, sort="status")["next_cursor"]
    by_time = listed(held, limit=2)["next_cursor"]
    for params in ({"sort": "method", "cursor": by_status}, {"cursor": by_status},
                   {"sort": "duration", "before": by_time}):  # fmt: skip
        response = held.client.get("/v1/jobs", params=params)
        assert response.status_code == 422, response.text
        assert "sort=" in response.json()["error"]["message"]
    both = held.client.get("/v1/jobs", params={"cursor": by_time, "before": by_time})
    assert both.status_code == 422 and both.json()["error"]["details"]["field"] == "before"
