"""POST /v1/merges with a mergekit config: translated at submit, run, recorded with the config
for lineage; what Layerswap cannot honour is a 422 naming the config's field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.reference import assert_equal, load
from tests.service.conftest import Service

CONFIG = """\
# a model card's config, as its YAML
merge_method: linear
models:
  - model: math
    parameters:
      weight: 0.3
  - model: swh
    parameters:
      weight: 0.7
parameters:
  normalize: true
dtype: float32
out_dtype: bfloat16
name: math-swh-linear
"""


def test_a_mergekit_config_runs_and_keeps_its_config(service: Service) -> None:
    job = service.submit({"mergekit": CONFIG})
    assert job["request"]["method"] == "linear"  # the job shows the recipe it runs
    assert job["request"]["params"] == {"weights": [0.3, 0.7], "normalize": True}
    assert job["request"]["mergekit"]["config"] == yaml.safe_load(CONFIG)
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    assert done["output"]["name"] == "math-swh-linear"

    location = Path(done["output"]["location"])
    merged = load(location)
    math, swh = load(service.checkpoints / "math"), load(service.checkpoints / "swh")
    for name, a in math.items():  # mergekit's linear: Σ w·T in float32, ÷ Σ w, then bf16
        weights = torch.tensor([0.3, 0.7], dtype=torch.float32)
        total = torch.zeros_like(a, dtype=torch.float32)
        total.addcmul_(a.float(), weights[0]).addcmul_(swh[name].float(), weights[1])
        assert_equal(merged[name], total.div_(weights.sum()).to(torch.bfloat16), name)
    manifest = json.loads((location / "layerswap.json").read_text())
    assert manifest["mergekit_config"] == yaml.safe_load(CONFIG)

    lineage = service.client.get(f"/v1/artifacts/{done['output']['artifact_id']}/lineage")
    (producer,) = lineage.json()["jobs"]
    assert producer["recipe"]["mergekit"]["config"]["merge_method"] == "linear"


def test_the_same_config_as_a_mapping_with_output_options(service: Service) -> None:
    config = yaml.safe_load(CONFIG) | {"name": None}
    job = service.submit({"mergekit": config, "output": {"name": "named-here"}})
    assert job["request"]["output"]["name"] == "named-here"
    assert job["request"]["output"]["dtype"] == "bfloat16"
    assert service.wait(job["id"])["status"] == "succeeded"


def test_a_tokenizer_source_becomes_the_recipes(service: Service) -> None:
    job = service.submit(with_fields(tokenizer={"source": "swh"}, name=None))
    assert job["request"]["tokenizer_source"] == f"model:{job['request']['models'][1]}"
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    manifest = json.loads((Path(done["output"]["location"]) / "layerswap.json").read_text())
    assert manifest["vocabulary"]["tokenizer_source"] == job["request"]["tokenizer_source"]


def refused(service: Service, body: dict[str, Any], field: str, words: str = "") -> str:
    response = service.client.post("/v1/merges", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["details"]["field"] == field, error
    assert error["message"].startswith(f"{field}: ")
    assert words in error["message"]
    return str(error["code"])


def with_fields(**fields: Any) -> dict[str, Any]:
    return {"mergekit": yaml.safe_load(CONFIG) | fields}


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        (with_fields(chat_template="zephyr"), "mergekit.chat_template", "neither auto"),
        (with_fields(merge_method="magic"), "mergekit.merge_method", "not a mergekit 0.1.5"),
        (with_fields(dtype="int64"), "mergekit.dtype", "computes in and writes bfloat16"),
        (with_fields(tokenizer={"source": "union", "pad_to_multiple_of": -64}),
         "mergekit.tokenizer.pad_to_multiple_of", "at least 1"),
        ({"mergekit": "merge_method: [linear"}, "mergekit", "not valid YAML"),
        ({"mergekit": "- a list"}, "mergekit", "must be a mapping"),
        ({**with_fields(), "output": {"dtype": "float16"}}, "output.dtype", "out_dtype"),
        ({**with_fields(), "method": "linear"}, "method", "unknown field"),
    ],
    ids=["chat_template", "method", "dtype", "tokenizer", "yaml", "not-mapping", "output",
         "both"],
)  # fmt: skip
def test_what_layerswap_cannot_honour_is_422_naming_the_field(
    service: Service, body: dict[str, Any], field: str, words: str
) -> None:
    refused(service, body, field, words)
    assert service.client.get("/v1/merges").json()["items"] == []


def test_an_arithmetic_beside_the_config_replaces_mergekits(service: Service) -> None:
    """A bf16 task-arithmetic config computes in bf16, as mergekit does; `arithmetic` beside
    the config asks for another (float32: Layerswap's), which the job's warnings say."""
    config = {
        "merge_method": "task_arithmetic",
        "base_model": "base",
        "models": [{"model": "math", "parameters": {"weight": 0.7}},
                   {"model": "swh", "parameters": {"weight": 0.45}}],
        "dtype": "bfloat16",
    }  # fmt: skip
    outputs = {}
    for asked in (None, "float32"):
        body = {"mergekit": config, **({"arithmetic": asked} if asked else {})}
        job = service.submit(body)
        assert job["request"]["arithmetic"] == (asked or "bfloat16")
        done = service.wait(job["id"])
        assert done["status"] == "succeeded", done["error"]
        location = Path(done["output"]["location"])
        manifest = json.loads((location / "layerswap.json").read_text())
        said = [w for w in manifest["warnings"] if w.startswith("arithmetic float32:")]
        assert len(said) == (1 if asked else 0)
        outputs[asked] = load(location)
    assert any(not torch.equal(t, outputs["float32"][n]) for n, t in outputs[None].items())
    refused(service, {"mergekit": config, "arithmetic": "float8"}, "arithmetic")


def test_per_model_densities_and_a_rescale_are_taken(service: Service) -> None:
    config = {
        "merge_method": "ties",
        "base_model": "base",
        "models": [{"model": "math", "parameters": {"weight": 1, "density": 0.5}},
                   {"model": "swh", "parameters": {"weight": 1, "density": 0.3}}],
    }  # fmt: skip
    response = service.client.post("/v1/merges", json={"mergekit": config})
    assert response.status_code == 202, response.text
    assert response.json()["request"]["params"]["density"] == [0.5, 0.3]
    config["parameters"] = {"rescale": True}
    response = service.client.post("/v1/merges", json={"mergekit": config})
    assert response.status_code == 202, response.text
    assert response.json()["request"]["params"]["rescale"] is True


def test_checks_that_need_the_checkpoints_name_the_configs_field(
    service: Service, tmp_path: Path
) -> None:
    sliced = {
        "merge_method": "slerp",
        "base_model": "math",
        "slices": [{"sources": [{"model": "math", "layer_range": [0, 40]},
                                {"model": "swh", "layer_range": [0, 40]}]}],
        "parameters": {"t": 0.5},
    }  # fmt: skip
    refused(service, {"mergekit": sliced}, "mergekit.slices.0.sources.0.layer_range", "outside")
    outside = tmp_path / "outside"
    outside.mkdir()
    config = yaml.safe_load(CONFIG)
    config["models"][1]["model"] = str(outside)
    code = refused(service, {"mergekit": config}, "mergekit.models.1.model", "outside")
    assert code == "source_not_allowed"


def test_hub_models_are_pinned_in_a_passthrough_config(
    service: Service, hub: Any, examples: Path
) -> None:
    """org/name is a Hub repository (no such directory under the source root): pinned to its
    commit in `models` and in the slices alike."""
    commits = {}
    for name in ("math", "swh"):
        hub.create_repo(f"org/mk-{name}")
        files = {p.name: p.read_bytes() for p in (examples / name).iterdir() if p.is_file()}
        commits[name] = str(hub.commit(f"org/mk-{name}", files, message="upload"))
    config = {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": "org/mk-math", "layer_range": [0, 3]}]},
                   {"sources": [{"model": "org/mk-swh@main", "layer_range": [3, 6]}]}],
    }  # fmt: skip
    job = service.submit({"mergekit": config})
    pinned = [f"hf://org/mk-math@{commits['math']}", f"hf://org/mk-swh@{commits['swh']}"]
    assert job["request"]["models"] == pinned
    slices = job["request"]["params"]["slices"]
    assert [s["sources"][0]["model"] for s in slices] == pinned
    assert [s["field"] for s in job["sources"]] == ["models.0", "models.1"]
    done = service.wait(job["id"])
    assert done["status"] == "succeeded", done["error"]
    merged = load(Path(done["output"]["location"]))
    math, swh = load(examples / "math"), load(examples / "swh")
    for layer, expert in ((0, math), (2, math), (3, swh), (5, swh)):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        assert_equal(merged[name], expert[name], name)
