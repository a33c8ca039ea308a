"""Registered models belong to the tenant that created them, against a real `mlflow server`:
another tenant can neither add a version to one nor move its alias, whether it is refused when
it submits or, having submitted before the model existed, when its merge registers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from service.auth import create_key
from tests.integrations.test_mlflow import registry, swap
from tests.service.conftest import Service, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from tests.service.test_api_tenants import bearer
from worker.pipeline import run_job

CHAMPION = {"registered_model": "tenant-swaps", "alias": "champion"}


@pytest.fixture
def held(tmp_path: Path, examples: Path, mlflow_server: str) -> Iterator[Service]:
    """Two tenants' service whose jobs run only when the test runs them, in its order."""
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, auth=True,
        mlflow_tracking_uri=mlflow_server, job_executor=HeldExecutor(),
    ) as running:  # fmt: skip
        yield running


def submit(service: Service, key: str, body: dict[str, Any]) -> str:
    response = service.client.post("/v1/merges", json=body, headers=bearer(key))
    assert response.status_code == 202, response.text
    return str(response.json()["id"])


def finished(service: Service, key: str, job_id: str) -> dict[str, Any]:
    run_job(job_id, db=service.db, settings=service.settings)
    return dict(service.client.get(f"/v1/merges/{job_id}", headers=bearer(key)).json())


def test_another_tenants_merge_cannot_take_a_model_or_its_alias(
    held: Service, mlflow_server: str
) -> None:
    a, b = create_key(held.db, "a"), create_key(held.db, "b")
    # B submits while the name is free; A's merge then creates the model and moves its alias.
    b_job = submit(held, b, swap("b-first", mlflow=CHAMPION))
    a_job = finished(held, a, submit(held, a, swap("a-first", mlflow=CHAMPION)))
    assert a_job["status"] == "succeeded", a_job["error"]
    assert a_job["result"]["mlflow"]["version"] == "1"

    # B's merge registers after A's: refused before it adds a version or moves the alias.
    b_done = finished(held, b, b_job)
    assert b_done["status"] == "failed"
    assert b_done["error"]["code"] == "mlflow_model_forbidden"
    assert "belongs to another tenant" in b_done["error"]["message"]
    client = registry(mlflow_server)
    versions = client.search_model_versions("name = 'tenant-swaps'")
    assert [(v.version, v.tags["layerswap.job_id"]) for v in versions] == [("1", a_job["id"])]
    assert client.get_model_version_by_alias("tenant-swaps", "champion").version == "1"
    assert client.get_registered_model("tenant-swaps").tags["layerswap.tenant"] == "a"

    # Now that the model exists, B's submit is refused at once, with nothing queued.
    queued = held.client.get("/v1/merges", headers=bearer(b)).json()["items"]
    refused = held.client.post(
        "/v1/merges", json=swap("b-late", mlflow=CHAMPION), headers=bearer(b)
    )
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "mlflow_model_forbidden"
    assert "another tenant" in refused.json()["error"]["message"]
    assert held.client.get("/v1/merges", headers=bearer(b)).json()["items"] == queued

    # A keeps registering into its model; B into a name of its own.
    a_again = finished(held, a, submit(held, a, swap("a-second", mlflow=CHAMPION)))
    assert a_again["result"]["mlflow"]["version"] == "2", a_again["error"]
    own = {"registered_model": "b-swaps", "alias": "champion"}
    b_own = finished(held, b, submit(held, b, swap("b-own", mlflow=own)))
    assert b_own["status"] == "succeeded", b_own["error"]
    assert client.get_model_version_by_alias("tenant-swaps", "champion").version == "2"


def test_a_model_the_service_did_not_create_is_nobodys(held: Service, mlflow_server: str) -> None:
    a = create_key(held.db, "a")
    registry(mlflow_server).create_registered_model("made-by-hand")
    body = swap("x", mlflow={"registered_model": "made-by-hand"})
    refused = held.client.post("/v1/merges", json=body, headers=bearer(a))
    assert refused.status_code == 403, refused.text
    assert refused.json()["error"]["code"] == "mlflow_model_forbidden"
    assert "no tenant owns it" in refused.json()["error"]["message"]
    assert registry(mlflow_server).search_model_versions("name = 'made-by-hand'") == []
