"""A mergekit config with a `model+adapter` reference through the API: both directories under
the allowed root, checked at submit; the job's output the adapted model, its lineage both."""

from __future__ import annotations

import json
from pathlib import Path

from tests.engine.test_lora_sources import adapted, assert_same, passthrough, save_adapter
from tests.reference import load
from tests.service.conftest import Service


def test_a_lora_reference_merges_through_the_api(service: Service) -> None:
    base = service.checkpoints / "base"
    save_adapter(base, service.checkpoints / "lora", "mlp-bf16-rslora", seed=5)
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    job = service.submit({"mergekit": passthrough("base+lora", layers)})
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    merged = load(Path(done["output"]["location"]))
    assert_same(merged, adapted(base, service.checkpoints / "lora"))
    assert not all(merged[n].equal(t) for n, t in load(base).items())
    lineage = service.client.get(f"/v1/artifacts/{done['output']['artifact_id']}/lineage")
    (producer,) = lineage.json()["jobs"]  # the model and its adapter, each an input
    assert [i["label"] for i in producer["inputs"]] == ["models[0]", "models[0].adapter"]


def test_an_adapter_outside_the_allowed_roots_is_refused(service: Service, tmp_path: Path) -> None:
    adapter = save_adapter(
        service.checkpoints / "base", tmp_path / "lora", "mlp-bf16-rslora", seed=5
    )
    response = service.client.post(
        "/v1/merges", json={"mergekit": passthrough(f"base+{adapter}", 4)}
    )
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["details"]["field"] == "mergekit.slices.0.sources.0.model", error
    assert f"{adapter} is outside the allowed source directories" in error["message"], error
