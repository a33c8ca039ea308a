"""Idempotency-Key: the same key and body give the same job, a different body is refused, and
concurrent duplicates never create two jobs."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from core.db.models import Job
from tests.service.conftest import Service, layer_swap, running_service


def jobs_in_db(service: Service) -> int:
    with service.db.session() as session:
        return int(session.scalar(select(func.count()).select_from(Job)) or 0)


def test_same_key_and_body_is_the_same_job(service: Service) -> None:
    body = layer_swap()
    first = service.client.post("/v1/merges", json=body, headers={"Idempotency-Key": "k-1"})
    again = service.client.post("/v1/merges", json=body, headers={"Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 202
    assert again.json()["id"] == first.json()["id"]
    assert again.headers["Location"] == first.headers["Location"]
    done = service.wait(first.json()["id"])
    assert done["status"] == "succeeded"

    # A retry long after the job finished still answers with that job, not a new one.
    later = service.client.post("/v1/merges", json=body, headers={"Idempotency-Key": "k-1"})
    assert later.status_code == 202
    assert later.json()["id"] == done["id"]
    assert later.json()["status"] == "succeeded"
    assert later.json()["output"]["artifact_id"] == done["output"]["artifact_id"]
    items = service.client.get("/v1/merges").json()["items"]
    assert [job["id"] for job in items] == [done["id"]]
    assert jobs_in_db(service) == 1


def test_same_key_is_compared_on_the_validated_request(service: Service) -> None:
    """Key order and spelled-out defaults do not make a different request."""
    body = layer_swap()
    spelled = {
        "params": {**body["params"], "bottom_transition": 0},
        "experts": body["experts"],
        "method": "layer_swap",
    }
    first = service.submit(body, **{"Idempotency-Key": "k-defaults"})
    second = service.submit(spelled, **{"Idempotency-Key": "k-defaults"})
    assert second["id"] == first["id"]
    service.wait(first["id"])
    assert jobs_in_db(service) == 1


def test_named_output_retry_returns_the_job_not_a_conflict(service: Service) -> None:
    body = {**layer_swap(), "output": {"name": "swapped"}}
    job = service.submit(body, **{"Idempotency-Key": "named"})
    assert service.wait(job["id"])["status"] == "succeeded"
    again = service.client.post("/v1/merges", json=body, headers={"Idempotency-Key": "named"})
    assert again.status_code == 202, again.text
    assert again.json()["id"] == job["id"]
    # Without the key it is a new request for a name that is taken.
    taken = service.client.post("/v1/merges", json=body)
    assert taken.status_code == 409
    assert taken.json()["error"]["details"]["field"] == "output.name"
    assert jobs_in_db(service) == 1


def test_same_key_with_a_different_body_is_422(service: Service) -> None:
    first = service.submit(layer_swap(), **{"Idempotency-Key": "k-2"})
    for other in [layer_swap(top=2), {**layer_swap(), "output": {"name": "other"}}]:
        response = service.client.post("/v1/merges", json=other, headers={"Idempotency-Key": "k-2"})
        assert response.status_code == 422
        error = response.json()["error"]
        assert error["code"] == "idempotency_key_reused"
        assert error["details"]["job_id"] == first["id"]
    # The same key on an analysis is a different request too.
    analysis = {"base": "base", "experts": [{"label": "math", "path": "math"}]}
    response = service.client.post(
        "/v1/analyses", json=analysis, headers={"Idempotency-Key": "k-2"}
    )
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "idempotency_key_reused"
    # Different keys, or no key, are different jobs.
    other = service.submit(layer_swap(), **{"Idempotency-Key": "k-3"})
    plain = service.submit(layer_swap())
    assert len({first["id"], other["id"], plain["id"]}) == 3
    for job_id in (first["id"], other["id"], plain["id"]):
        assert service.wait(job_id)["status"] == "succeeded"
    assert jobs_in_db(service) == 3


def post_all_at_once(app: Any, bodies: list[dict[str, Any]], key: str) -> list[httpx.Response]:
    """Each body from its own thread and client, released together by a barrier."""
    barrier = threading.Barrier(len(bodies))

    def post(body: dict[str, Any]) -> httpx.Response:
        client = TestClient(app)  # its own client and event loop; the app is shared
        barrier.wait(timeout=30)
        return client.post("/v1/merges", json=body, headers={"Idempotency-Key": key})

    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(post, bodies))


@pytest.mark.parametrize("store", ["postgres", "sqlite"])
def test_concurrent_duplicates_create_one_job(
    store: str, tmp_path: Path, examples: Path, request: pytest.FixtureRequest
) -> None:
    """Fresh database: the tenant row and the job are both raced for."""
    url = (
        request.getfixturevalue("postgres_url")
        if store == "postgres"
        else f"sqlite:///{tmp_path / 'layerswap.db'}"
    )
    with running_service(tmp_path, url, examples) as service:
        responses = post_all_at_once(service.client.app, [layer_swap()] * 8, "race")
        assert [r.status_code for r in responses] == [202] * 8, [r.text for r in responses]
        ids = {r.json()["id"] for r in responses}
        assert len(ids) == 1
        assert jobs_in_db(service) == 1
        (job_id,) = ids
        assert service.wait(job_id)["status"] == "succeeded"
        assert service.wait(job_id)["attempts"] == 1


def test_concurrent_different_bodies_on_one_key_create_one_job(
    postgres_url: str, tmp_path: Path, examples: Path
) -> None:
    with running_service(tmp_path, postgres_url, examples) as service:
        bodies = [layer_swap(top=top) for top in range(1, 6)]  # all valid for 6 layers
        responses = post_all_at_once(service.client.app, bodies, "race-different")
        statuses = sorted(r.status_code for r in responses)
        assert statuses == [202] + [422] * 4, [r.text for r in responses]
        (winner,) = [r.json() for r in responses if r.status_code == 202]
        for response in responses:
            if response.status_code == 422:
                error = response.json()["error"]
                assert error["code"] == "idempotency_key_reused"
                assert error["details"]["job_id"] == winner["id"]
        assert jobs_in_db(service) == 1
        service.wait(winner["id"])
