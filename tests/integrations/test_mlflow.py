"""MLflow Model Registry against a real `mlflow server`, read back with MLflow's own client:
a merge becomes a model version (source, tags, alias), published merges point at their Hub
commit, evaluation scores arrive as tags, a retried job makes no second version, and bad
requests and an unreachable registry are clear errors."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from core.integrations import mlflow_registry
from engine.recipe import MlflowDestination
from tests.evaluation.conftest import TASK, Model
from tests.evaluation.test_api import EVALUATION
from tests.service.conftest import Service, layer_swap, running_service

TOKEN = "hf_mlflow_token_0123456789abcdef"
CHAMPION = {"registered_model": "swaps", "alias": "champion"}


@pytest.fixture
def service(
    tmp_path: Path, examples: Path, mlflow_server: str, math_expert: Model, hub: Any
) -> Iterator[Service]:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        mlflow_tracking_uri=mlflow_server, eval_data_dir=math_expert.data_dir,
        hub_credentials={"default": {"team-a": TOKEN}},
    ) as running:  # fmt: skip
        yield running


def registry(url: str) -> Any:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=url, registry_uri=url)


def swap(name: str, **output: Any) -> dict[str, Any]:
    return {**layer_swap(), "output": {"name": name, **output}}


def test_a_merge_becomes_a_model_version_with_its_lineage(
    service: Service, mlflow_server: str
) -> None:
    job = service.wait(service.submit(swap("v1", mlflow=CHAMPION))["id"])
    assert job["status"] == "succeeded", job["error"]
    recorded = job["result"]["mlflow"]
    assert (recorded["registered_model"], recorded["version"]) == ("swaps", "1")
    client = registry(mlflow_server)
    version = client.get_model_version_by_alias("swaps", "champion")
    assert version.version == "1" and version.source == f"layerswap:/v1/merges/{job['id']}"
    tags = version.tags
    assert tags["layerswap.job_id"] == job["id"]
    assert tags["layerswap.method"] == "layer_swap"
    assert json.loads(tags["layerswap.params"]) == job["request"]["params"]
    assert tags["layerswap.plan_digest"] == job["plan_digest"]
    artifact = service.client.get(f"/v1/artifacts/{job['output']['artifact_id']}").json()
    assert tags["layerswap.content_digest"] == artifact["content_digest"]
    lineage = service.client.get(f"/v1/artifacts/{artifact['id']}/lineage").json()
    digests = {a["location"]: a["content_digest"] for a in lineage["artifacts"]}
    inputs = json.loads(tags["layerswap.inputs"])
    assert {i["role"] for i in inputs} == {"task", "language"}
    for entry in inputs:
        assert entry["content_digest"] == digests[str(service.checkpoints / entry["source"])]

    # A retried attempt (registered, then died before recording) finds its version.
    again = mlflow_registry.register(
        service.settings, tenant="default", job_id=job["id"], request=job["request"],
        destination=MlflowDestination(registered_model="swaps", alias="champion"),
        files={f["name"]: f["sha256"] for f in job["output"]["files"]},
        plan_digest=job["plan_digest"], sources=inputs, published=None,
        artifact_hint=f"/v1/merges/{job['id']}",
    )  # fmt: skip
    assert again["version"] == "1"
    second = service.wait(service.submit(swap("v2", mlflow=CHAMPION))["id"])
    assert second["result"]["mlflow"]["version"] == "2"
    versions = client.search_model_versions("name = 'swaps'")
    assert sorted(v.version for v in versions) == ["1", "2"]  # one per job, no duplicate
    assert client.get_model_version_by_alias("swaps", "champion").version == "2"


def test_published_merges_point_at_their_commit_and_scores_arrive_as_tags(
    service: Service, mlflow_server: str, hub: Any
) -> None:
    body = swap("published", hub={"repo": "team-a/swapped", "credential": "team-a"},
                mlflow={"registered_model": "published-swaps"})  # fmt: skip
    job = service.wait(service.submit({**body, "evaluation": EVALUATION})["id"])
    assert job["status"] == "succeeded", job["error"]
    commit = job["result"]["published"]["commit"]
    assert commit == hub.head("team-a/swapped")
    client = registry(mlflow_server)
    (version,) = client.search_model_versions("name = 'published-swaps'")
    assert version.source == f"hf://team-a/swapped@{commit}"

    evaluation = service.wait(job["result"]["evaluation_job_id"], kind="evaluations")
    assert evaluation["status"] == "succeeded", evaluation["error"]
    assert [(m["registered_model"], m["tagged"]) for m in evaluation["result"]["mlflow"]] == [
        ("published-swaps", True)
    ]
    tags = client.get_model_version("published-swaps", version.version).tags
    for score in evaluation["result"]["scores"]:
        key = f"eval.{score['task']}.{score['metric']}.{score['filter']}"
        assert float(tags[key]) == score["value"], key
    assert any(k.startswith(f"eval.{TASK}.exact_match.") for k in tags)


def test_bad_requests_and_an_unreachable_registry_are_clear_errors(
    tmp_path: Path, examples: Path, service: Service, monkeypatch: pytest.MonkeyPatch
) -> None:
    latest = {"registered_model": "m", "alias": "latest"}
    bad = service.client.post("/v1/merges", json=swap("x", mlflow=latest))
    assert bad.status_code == 422 and "output.mlflow.alias" in bad.text
    quoted = service.client.post("/v1/merges", json=swap("x", mlflow={"registered_model": "a'b"}))
    assert quoted.status_code == 422 and "registered_model" in quoted.text

    with running_service(
        tmp_path / "plain", f"sqlite:///{tmp_path / 'plain.db'}", examples
    ) as plain:
        refused = plain.client.post("/v1/merges", json=swap("x", mlflow={"registered_model": "m"}))
        assert refused.status_code == 422
        assert refused.json()["error"]["code"] == "mlflow_not_configured"
        assert plain.client.get("/v1/merges").json()["items"] == []

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    monkeypatch.setattr(mlflow_registry, "TRIES", 1)
    with running_service(tmp_path / "down", f"sqlite:///{tmp_path / 'down.db'}", examples,
                         mlflow_tracking_uri="http://127.0.0.1:9") as down:  # fmt: skip
        job = down.wait(down.submit(swap("lost", mlflow={"registered_model": "m"}))["id"])
        assert job["status"] == "failed" and job["error"]["code"] == "mlflow_failed"
        assert "registering m failed" in job["error"]["message"]
        assert not (down.settings.artifacts_dir / "default" / "lost").exists()
