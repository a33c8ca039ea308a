"""Merge jobs end to end over HTTP, on SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.service.conftest import Service, layer_swap, running_service


def test_layer_swap_job_succeeds_with_output_and_lineage(service: Service) -> None:
    response = service.client.post("/v1/merges", json=layer_swap(), headers={})
    assert response.status_code == 202
    job = response.json()
    assert response.headers["Location"] == f"/v1/merges/{job['id']}"
    assert job["status"] in {"queued", "running", "succeeded"}

    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1
    assert done["progress"]["fraction"] == 1.0
    assert done["progress"]["tensors_done"] == done["progress"]["tensors_total"] > 0
    assert [row["origin"] for row in done["plan"]][:2] == ["language", "task"]

    output = done["output"]
    location = Path(output["location"])
    for entry in output["files"]:
        digest = hashlib.sha256((location / entry["name"]).read_bytes()).hexdigest()
        assert digest == entry["sha256"]
    merged = load_file(location / "model.safetensors")
    swh = load_file(service.checkpoints / "swh" / "model.safetensors")
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(merged[name], swh[name])

    lineage = service.client.get(f"/v1/artifacts/{output['artifact_id']}/lineage").json()
    (producer,) = lineage["jobs"]
    assert producer["job_id"] == job["id"]
    assert {(i["role"], i["label"]) for i in producer["inputs"]} == {
        ("task", "task[0]"),
        ("language", "language[0]"),
    }
    inputs = {a["id"]: a for a in lineage["artifacts"]}
    for edge in producer["inputs"]:
        files = {f["name"]: f["sha256"] for f in inputs[edge["artifact_id"]]["files"]}
        source = service.checkpoints / ("math" if edge["role"] == "task" else "swh")
        real = hashlib.sha256((source / "model.safetensors").read_bytes()).hexdigest()
        assert files["model.safetensors"] == real


def test_invalid_recipe_is_422_naming_the_field_and_queues_nothing(service: Service) -> None:
    bad = layer_swap(bottom=5, top=2, bottom_transition=1)  # fine schema-wise
    bad["params"]["unknown"] = 1
    response = service.client.post("/v1/merges", json=bad)
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["details"]["field"] == "params.unknown"
    assert "params.unknown" in error["message"]
    assert service.client.get("/v1/merges").json()["items"] == []


def test_source_outside_allowed_roots_is_422(service: Service, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (service.checkpoints / "link").symlink_to(outside)
    for source in ["../../outside", str(outside), "link"]:
        body = layer_swap()
        body["experts"]["task"] = [source]
        response = service.client.post("/v1/merges", json=body)
        assert response.status_code == 422, source
        assert response.json()["error"]["code"] == "source_not_allowed"
        assert response.json()["error"]["details"]["field"] == "experts.task.0"


def test_submit_answers_the_job_as_a_read_of_it_does(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """The submit's answer is serialised on the request's thread, not by FastAPI: the same
    JSON document a GET of the job gives, as application/json, with its Location."""
    from tests.service.test_api_lifecycle import HeldExecutor

    held = HeldExecutor()
    with running_service(tmp_path, database_url, examples, job_executor=held) as service:
        response = service.client.post("/v1/merges", json=layer_swap())
        assert response.status_code == 202, response.text
        assert response.headers["content-type"] == "application/json"
        job = response.json()
        assert response.headers["Location"] == f"/v1/merges/{job['id']}"
        assert held.dispatched == [job["id"]]
        read = service.client.get(f"/v1/merges/{job['id']}")
        assert job == read.json()
        assert job["status"] == "queued" and job["request"]["method"] == "layer_swap"
