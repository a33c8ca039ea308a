"""Layers the engine cannot see by name: a layer swap refuses them instead of averaging them.

Falcon names its layers `transformer.h.<n>`; the engine recognises `…layers.<n>.…`. A method
that treats layers differently must then stop with an error naming the tensors it saw, while
methods that merge every tensor alike keep working. The Falcon checkpoints are real ones, saved
by transformers' FalconForCausalLM.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.analysis import analyze
from engine.errors import CheckpointError
from tests.conftest import Family
from tests.helpers import leftovers, write_recipe
from tests.reference import assert_equal, combine, load
from tests.test_cli import layerswap

FALCON_LAYERS = 3


@dataclass(frozen=True)
class Falcon:
    base: Path
    task: Path
    language: Path


def save_falcon(out: Path, seed: int) -> Path:
    from transformers import FalconConfig, FalconForCausalLM

    torch.manual_seed(seed)
    config = FalconConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=FALCON_LAYERS, num_attention_heads=4
    )
    FalconForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def falcon(tmp_path_factory: pytest.TempPathFactory) -> Falcon:
    root = tmp_path_factory.mktemp("falcon")
    names = [f.name for f in fields(Falcon)]
    return Falcon(*(save_falcon(root / name, seed) for seed, name in enumerate(names)))


def swap(task: Path, language: Path) -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": [task], "language": [language]},
        "params": {"bottom": 1, "top": 1},
    }


def test_the_fixture_is_a_real_falcon_with_unrecognised_layer_names(falcon: Falcon) -> None:
    names = set(load_file(str(falcon.task / "model.safetensors")))
    assert "transformer.h.0.self_attention.query_key_value.weight" in names
    assert not any(".layers." in name for name in names)
    config = json.loads((falcon.task / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"]) == ("falcon", FALCON_LAYERS)


def test_a_layer_swap_of_falcon_is_refused_naming_its_tensors(
    falcon: Falcon, run_merge: Any, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(falcon.task, falcon.language), out)
    error = info.value
    assert error.code == "invalid_checkpoint"
    assert error.details["path"] == str(falcon.task)
    assert "layer_swap needs the transformer layers" in error.message
    assert "transformer.h.<n>.input_layernorm.weight" in error.message  # the names it saw
    assert "'falcon'" in error.message
    assert "\n" not in error.message
    assert leftovers(out) == []


def test_the_cli_refuses_a_falcon_layer_swap_in_one_line(falcon: Falcon, tmp_path: Path) -> None:
    recipe = write_recipe(tmp_path / "swap.yaml", swap(falcon.task, falcon.language))
    out = tmp_path / "merged"
    proc = layerswap("merge", recipe, "--out", out, "-q", "--no-fsync", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("layerswap: error [invalid_checkpoint]")
    assert str(falcon.task) in lines[0]
    assert "transformer.h.<n>." in lines[0]
    assert leftovers(out) == []


def test_a_soup_of_falcon_still_merges_every_tensor(falcon: Falcon, run_merge: Any) -> None:
    result = run_merge({"method": "soup", "models": [falcon.task, falcon.language]})
    inputs = [load(falcon.task), load(falcon.language)]
    out = load(result.out_dir)
    assert set(out) == set(inputs[0])
    for name, first in inputs[0].items():
        expected = combine([0.5, 0.5], [m[name] for m in inputs]).to(first.dtype)
        assert_equal(out[name], expected, name)


def test_a_delta_analysis_of_falcon_is_refused(falcon: Falcon) -> None:
    with pytest.raises(CheckpointError) as info:
        analyze(base=falcon.base, experts=[("task", falcon.task), ("language", falcon.language)])
    assert "delta analysis needs the transformer layers" in info.value.message
    assert "transformer.h.<n>." in info.value.message


def without_layer(source: Path, out: Path, layer: int) -> Path:
    """A copy of a checkpoint whose weights lack every tensor of one layer."""
    shutil.copytree(source, out)
    tensors = load_file(str(out / "model.safetensors"))
    kept = {n: t for n, t in tensors.items() if f".layers.{layer}." not in n}
    assert len(kept) < len(tensors)
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_fewer_recognised_layers_than_configured_are_refused(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    last = llama.num_layers - 1
    task = without_layer(llama.task, tmp_path / "task", last)
    language = without_layer(llama.language, tmp_path / "language", last)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(task, language), out)
    assert info.value.details["path"] == str(task)
    assert f"config says {llama.num_layers} layers" in info.value.message
    assert f"missing {last})" in info.value.message
    assert leftovers(out) == []


def test_more_configured_layers_than_the_tensors_hold_are_refused(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    task = shutil.copytree(llama.task, tmp_path / "task")
    config = json.loads((task / "config.json").read_text())
    (task / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 8}))
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(task, llama.language), tmp_path / "out")
    assert info.value.details["path"] == str(task)
    assert "config says 8 layers" in info.value.message
    assert "missing 6, 7)" in info.value.message
