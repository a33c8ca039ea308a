"""The submit's header checks remember what passed, by recipe and input files: a checkpoint
changed after a check passed is checked again, never waved through."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import Service, running_service


@pytest.fixture
def api(tmp_path: Path, examples: Path) -> Iterator[Service]:
    with running_service(tmp_path, f"sqlite:///{tmp_path / 'layerswap.db'}", examples) as running:
        yield running


def soup_of(*models: str) -> dict[str, Any]:
    return {"method": "soup", "models": list(models)}


def test_a_checkpoint_changed_after_a_passed_check_is_checked_again(api: Service) -> None:
    changing = api.checkpoints / "changing"
    shutil.copytree(api.checkpoints / "swh", changing)
    body = soup_of("math", "changing")
    for _ in range(2):  # the second answer comes from what the first check remembered
        assert api.client.post("/v1/merges", json=body).status_code == 202

    config = json.loads((changing / "config.json").read_text())
    (changing / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    response = api.client.post("/v1/merges", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "incompatible_checkpoints"

    (changing / "config.json").write_text(json.dumps(config))  # as it was: passes again
    assert api.client.post("/v1/merges", json=body).status_code == 202

    from safetensors.torch import load_file, save_file

    tensors = load_file(str(changing / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(changing / "model.safetensors"), metadata={"format": "pt"})
    response = api.client.post("/v1/merges", json=body)
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    assert error["code"] == "incompatible_checkpoints" and "model.norm.weight" in error["message"]


def test_the_same_files_under_another_recipe_are_checked_for_that_recipe(api: Service) -> None:
    fine = {"method": "layer_swap", "experts": {"task": ["math"], "language": ["swh"]},
            "params": {"bottom": 1, "top": 1}}  # fmt: skip
    assert api.client.post("/v1/merges", json=fine).status_code == 202
    too_many = {**fine, "params": {"bottom": 3, "top": 2, "bottom_transition": 1,
                                   "top_transition": 1}}  # fmt: skip
    response = api.client.post("/v1/merges", json=too_many)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["details"]["field"] == "params"
