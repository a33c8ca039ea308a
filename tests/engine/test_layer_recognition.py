"""Finding the language model's layers when the family table does not list the model.

A checkpoint of an unlisted `model_type` is inferred from its tensor names: the one group
`<prefix>.<n>.…` numbered 0..L-1, L its configured layer count. A method that treats layers
differently refuses, naming what it saw, when that is not exactly one group; methods that merge
every tensor alike keep working, with or without a layer count. The checkpoints here are
written by hand (no transformers class knows them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.analysis.deltas import analyze
from engine.errors import CheckpointError
from tests.conftest import Family
from tests.helpers import leftovers, write_recipe
from tests.reference import assert_equal, combine, load, swap_region
from tests.test_cli import layerswap

LAYERS = 4
SWAP = {"bottom": 1, "bottom_transition": 1, "top": 1}


def save_custom(out: Path, seed: int, stacks: tuple[str, ...], config: dict[str, Any]) -> Path:
    """A checkpoint of an unlisted family: embeddings, LAYERS layers per stack, a head."""
    generator = torch.Generator().manual_seed(seed)

    def tensor(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(torch.bfloat16)

    tensors = {"embed.weight": tensor(16, 8), "head.weight": tensor(16, 8)}
    for stack in stacks:
        for i in range(LAYERS):
            tensors[f"{stack}.{i}.attn.weight"] = tensor(8, 8)
            tensors[f"{stack}.{i}.norm.weight"] = tensor(8)
            tensors[f"{stack}.{i}.experts.{i % 2}.weight"] = tensor(8, 8)  # numbered inside
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({"model_type": "tinyblocks", **config}))
    return out


def pair(root: Path, stacks: tuple[str, ...], config: dict[str, Any]) -> tuple[Path, Path]:
    return save_custom(root / "task", 1, stacks, config), save_custom(
        root / "language", 2, stacks, config
    )


def swap(task: Path, language: Path) -> dict[str, Any]:
    experts = {"task": [task], "language": [language]}
    return {"method": "layer_swap", "experts": experts, "params": SWAP}


def test_an_unlisted_family_with_blocks_is_inferred_and_swapped(
    run_merge: Any, tmp_path: Path
) -> None:
    task, language = pair(tmp_path, ("blocks",), {"num_layers": LAYERS})
    result = run_merge(swap(task, language))
    inputs = {"task": load(task), "language": load(language)}
    out = load(result.out_dir)
    assert set(out) == set(inputs["task"])
    for name, t in inputs["task"].items():
        parts = name.split(".")
        if parts[0] == "blocks":
            origin = swap_region(int(parts[1]), LAYERS, 1, 1, 1, 0)
        else:
            origin = "transition"  # non-layer: the average, as a transition layer is
        if origin == "transition":
            expected = combine([0.5, 0.5], [t, inputs["language"][name]]).to(t.dtype)
        else:
            expected = inputs[origin][name]
        assert_equal(out[name], expected, name)
    stack = result.manifest["layer_stack"]
    assert stack["rule"] == "inferred from tensor names"
    assert (stack["prefix"], stack["count"], stack["count_key"]) == ("blocks", 4, "num_layers")


def test_the_dry_run_says_which_rule_found_the_layers(tmp_path: Path) -> None:
    task, language = pair(tmp_path, ("blocks",), {"num_layers": LAYERS})
    recipe = write_recipe(tmp_path / "swap.yaml", swap(task, language))
    proc = layerswap("merge", recipe, "--out", tmp_path / "out", "--dry-run", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "layers: blocks.<n> × 4 (inferred from tensor names" in proc.stdout


def test_two_candidate_stacks_are_refused_naming_them(run_merge: Any, tmp_path: Path) -> None:
    task, language = pair(tmp_path, ("encoder.blocks", "decoder.blocks"), {"n_layer": LAYERS})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(task, language), out)
    message = info.value.message
    assert info.value.details["path"] == str(task)
    assert "layer_swap needs the language model's layer stack" in message
    assert "'tinyblocks' is not in the family table" in message
    assert "decoder.blocks.<n>., encoder.blocks.<n>." in message
    assert "\n" not in message
    assert leftovers(out) == []


def test_the_cli_refuses_an_ambiguous_layer_swap_in_one_line(tmp_path: Path) -> None:
    task, language = pair(tmp_path, ("encoder.blocks", "decoder.blocks"), {"n_layer": LAYERS})
    recipe = write_recipe(tmp_path / "swap.yaml", swap(task, language))
    out = tmp_path / "merged"
    proc = layerswap("merge", recipe, "--out", out, "-q", "--no-fsync", cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr  # no traceback
    assert lines[0].startswith("layerswap: error [invalid_checkpoint]")
    assert "encoder.blocks.<n>." in lines[0]
    assert leftovers(out) == []


@pytest.mark.parametrize(
    ("stacks", "config"),
    [
        (("encoder.blocks", "decoder.blocks"), {"n_layer": LAYERS}),
        (("blocks",), {}),  # no layer count configured
        (("blocks",), {"num_layers": LAYERS + 1}),  # no group numbers 0..L-1
    ],
    ids=["two-stacks", "no-count", "count-matches-no-group"],
)
def test_a_soup_merges_whatever_the_layers(
    stacks: tuple[str, ...], config: dict[str, Any], run_merge: Any, tmp_path: Path
) -> None:
    task, language = pair(tmp_path, stacks, config)
    result = run_merge({"method": "soup", "models": [task, language]})
    inputs, out = [load(task), load(language)], load(result.out_dir)
    assert set(out) == set(inputs[0])
    for name, first in inputs[0].items():
        assert_equal(out[name], combine([0.5, 0.5], [m[name] for m in inputs]).to(first.dtype))
    assert result.manifest["layer_stack"]["rule"] == "none"
    assert result.manifest["layers"] == [
        {"layer": "non-layer", "origin": "soup", "made_from": "0.5×models[0] + 0.5×models[1]"}
    ]


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ({}, "no layer count (looked for text_config.num_hidden_layers"),
        ({"num_layers": LAYERS + 1}, "no group of tensor names <prefix>.<n>. numbers 0..4"),
    ],
    ids=["no-count", "no-matching-group"],
)
def test_a_layer_swap_without_a_stack_is_refused(
    config: dict[str, Any], said: str, run_merge: Any, tmp_path: Path
) -> None:
    task, language = pair(tmp_path, ("blocks",), config)
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(task, language), tmp_path / "out")
    assert said in info.value.message
    assert "blocks.<n>.attn.weight" in info.value.message  # the names it saw


def test_a_listed_family_with_other_names_is_refused(run_merge: Any, tmp_path: Path) -> None:
    task, language = pair(tmp_path, ("blocks",), {"num_hidden_layers": LAYERS})
    for checkpoint in (task, language):
        config = json.loads((checkpoint / "config.json").read_text())
        (checkpoint / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError) as info:
        run_merge(swap(task, language), tmp_path / "out")
    message = info.value.message
    assert "model_type 'llama' keeps its layers at model.layers.<n>." in message
    assert "blocks.<n>.attn.weight" in message


def test_a_delta_analysis_of_an_ambiguous_checkpoint_is_refused(tmp_path: Path) -> None:
    stacks = ("encoder.blocks", "decoder.blocks")
    base = save_custom(tmp_path / "base", 0, stacks, {"n_layer": LAYERS})
    task, language = pair(tmp_path, stacks, {"n_layer": LAYERS})
    with pytest.raises(CheckpointError) as info:
        analyze(base=base, experts=[("task", task), ("language", language)])
    assert "delta analysis needs the language model's layer stack" in info.value.message
    assert "encoder.blocks.<n>." in info.value.message


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


def test_deepseek_v3_multi_token_prediction_layer_is_not_swapped(
    run_merge: Any, tmp_path: Path
) -> None:
    """DeepSeek-V3 stores its MTP module as layer L (num_nextn_predict_layers after the L
    counted ones): it is not part of the language stack, so it is made like a non-layer
    tensor, and the stack still counts L layers."""
    config = {"num_hidden_layers": LAYERS, "num_nextn_predict_layers": 1}
    dirs = []
    for seed, role in ((1, "task"), (2, "language")):
        # LAYERS + 1 numbered layers: 0..LAYERS-1 and the MTP layer
        out = save_custom(tmp_path / "tmp" / role, seed, (), {})
        tensors = load_file(str(out / "model.safetensors"))
        generator = torch.Generator().manual_seed(seed + 10)
        for i in range(LAYERS + 1):
            tensors[f"model.layers.{i}.attn.weight"] = torch.randn(8, 8, generator=generator).to(
                torch.bfloat16
            )
        final = tmp_path / role
        final.mkdir()
        save_file(tensors, str(final / "model.safetensors"), metadata={"format": "pt"})
        (final / "config.json").write_text(json.dumps({"model_type": "deepseek_v3", **config}))
        dirs.append(final)
    task, language = dirs
    result = run_merge(swap(task, language))
    inputs = {"task": load(task), "language": load(language)}
    out = load(result.out_dir)
    mtp = f"model.layers.{LAYERS}.attn.weight"
    average = combine([0.5, 0.5], [inputs["task"][mtp], inputs["language"][mtp]])
    assert_equal(out[mtp], average.to(torch.bfloat16), mtp)
    top = f"model.layers.{LAYERS - 1}.attn.weight"  # the last counted layer: language's
    assert_equal(out[top], inputs["language"][top], top)
    stack = result.manifest["layer_stack"]
    assert (stack["rule"], stack["prefix"], stack["count"]) == ("family table", "model.layers", 4)
