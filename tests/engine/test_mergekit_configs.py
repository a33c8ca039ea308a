"""Real mergekit YAML configs run by `layerswap merge` (a subprocess, as a user runs it) and by
mergekit 0.1.5 (.venv-bench): every output tensor equal, bit for bit. Also what only the
checkpoints can tell: a slice's depth, different vocabularies (tokenizer_source), the dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from tests.conftest import Family
from tests.engine.mergekit_parity import mergekit_reply, run_mergekit, ulp_distance
from tests.engine.sparsify_reference import gradient, tie_ambiguous
from tests.engine.test_output import assert_forward_pass
from tests.engine.vocabularies import ChatFamily, embedding_names, make_chat_family, vocabulary
from tests.reference import layer_of, load
from tests.test_cli import LAYERSWAP, layerswap

FILTERED_T = [
    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
    {"value": 0.5},
]


def configs(llama: Family, llama32: Family) -> dict[str, dict[str, Any]]:
    """One config per method, as a model card would hold it, each computed in its `dtype` as
    mergekit computes (bf16 and fp16 configs of every method: test_mergekit_arithmetic.py)."""
    m, m32 = (lambda x: str(getattr(llama, x))), (lambda x: str(getattr(llama32, x)))
    return {
        "linear": {
            "merge_method": "linear",
            "models": [
                {"model": m("task"), "parameters": {"weight": [1, 0, 2]}},
                {"model": m("language"), "parameters": {"weight": 0.5}},
                {"model": m("task2"), "parameters": {"weight": [{"filter": "mlp", "value": 0.2}]}},
            ],
            "parameters": {"weight": 0.7, "normalize": True},
            "dtype": "bfloat16",
        },
        "slerp": {
            "slices": [
                {
                    "sources": [
                        {"model": m32("task"), "layer_range": [0, 6]},
                        {"model": m32("language"), "layer_range": [0, 6]},
                    ]
                }
            ],
            "merge_method": "slerp",
            "base_model": m32("task"),
            "parameters": {"t": FILTERED_T},
            "dtype": "float32",
        },
        "ties": {
            "models": [
                {"model": m32("base")},
                {"model": m32("task"), "parameters": {"density": 0.5, "weight": 0.7}},
                {"model": m32("language"), "parameters": {"density": 0.5, "weight": 0.3}},
            ],
            "merge_method": "ties",
            "base_model": m32("base"),
            "parameters": {"normalize": True, "lambda": 1.2},
            "tokenizer_source": "base",
            "dtype": "float32",
        },
        "task_arithmetic": {
            "models": [
                {"model": m32("task"), "parameters": {"weight": 0.7}},
                {"model": m32("language"), "parameters": {"weight": -0.3}},
                {"model": m32("task2"), "parameters": {"weight": 0.45}},
            ],
            "merge_method": "task_arithmetic",
            "base_model": m32("base"),
            "parameters": {"lambda": 1.3, "normalize": True},
            "dtype": "float32",
        },
        "breadcrumbs": {
            "merge_method": "breadcrumbs",
            "base_model": m32("base"),
            "models": [
                {"model": m32("task"), "parameters": {"weight": 0.7, "gamma": 0.05}},
                {"model": m32("language"), "parameters": {"weight": [0.2, 0.6]}},
            ],
            "parameters": {"density": 0.8, "gamma": 0.1, "normalize": True},
            "dtype": "float32",
        },
        "breadcrumbs_ties": {
            "merge_method": "breadcrumbs_ties",
            "base_model": m32("base"),
            "models": [
                {"model": m32("task"), "parameters": {"weight": 1.0, "density": [0.4, 0.9]}},
                {"model": m32("language"), "parameters": {"weight": 0.6, "density": 0.7}},
            ],
            "parameters": {"gamma": 0.02, "lambda": 0.8},
            "dtype": "float32",
        },
        "passthrough": {
            "slices": [
                {"sources": [{"model": m("task"), "layer_range": [0, 4]}]},
                {"sources": [{"model": m("language"), "layer_range": [2, 6]}]},
            ],
            "merge_method": "passthrough",
            "dtype": "bfloat16",
        },
        "nuslerp": {
            "models": [
                {"model": m32("task"), "parameters": {"weight": [0.2, 1.0]}},
                {"model": m32("language"), "parameters": {"weight": 0.5}},
            ],
            "merge_method": "nuslerp",
            "base_model": m32("base"),
            "parameters": {"nuslerp_flatten": [{"filter": "mlp", "value": False}]},
            "dtype": "float32",
        },
        "nuslerp-models": {  # no base: of the models themselves; columns in attention
            "models": [
                {"model": m32("task"), "parameters": {"weight": 0.3}},
                {"model": m32("task2"), "parameters": {"weight": [0.9, 0.1]}},
            ],
            "merge_method": "nuslerp",
            "parameters": {
                "nuslerp_flatten": False,
                "nuslerp_row_wise": [{"filter": "self_attn", "value": True}],
            },
            "dtype": "float32",
        },
        "model_stock": {
            "models": [{"model": m32(x)} for x in ("base", "task", "language", "task2")],
            "merge_method": "model_stock",
            "base_model": m32("base"),
            "parameters": {"filter_wise": [True, False]},
            "dtype": "float32",
        },
    }


def tied_at_a_cut(config: dict[str, Any], name: str, *, layers: int) -> torch.Tensor:
    """Entries of tensor `name` whose breadcrumbs mask hangs on how mergekit's sort (not
    stable) orders equal |δ| at a cut, for any of the config's models: there the two may
    keep different entries (tests/engine/test_mergekit_parity.py)."""
    base = load(Path(config["base_model"]))[name].float()
    found = torch.zeros_like(base, dtype=torch.bool)
    for entry in config["models"]:
        found_in = {**config["parameters"], **entry["parameters"]}

        def value(v: Any) -> float:
            return gradient(v, layer_of(name), layers) if isinstance(v, list) else float(v)

        delta = load(Path(entry["model"]))[name].float() - base
        found |= tie_ambiguous(delta, value(found_in.get("density", 1.0)),
                               value(found_in["gamma"]))  # fmt: skip
    return found


def merge_config(config: dict[str, Any], tmp_path: Path, *args: str) -> Any:
    config_file = tmp_path / "config.yml"
    config_file.write_text(yaml.safe_dump(config, sort_keys=False))
    return layerswap("merge", config_file, "--out", tmp_path / "ours", "-q", *args, cwd=tmp_path)


@pytest.mark.parametrize(
    "case",
    ["linear", "slerp", "ties", "task_arithmetic", "breadcrumbs", "breadcrumbs_ties",
     "passthrough", "nuslerp", "nuslerp-models", "model_stock"],
)  # fmt: skip
def test_a_mergekit_config_merges_as_mergekit_does(
    case: str, llama: Family, llama32: Family, tmp_path: Path
) -> None:
    config = configs(llama, llama32)[case]
    method = config["merge_method"]
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    ours, theirs = tmp_path / "ours", run_mergekit(config, tmp_path / "mergekit")
    mine, reference = load(ours), load(theirs)
    assert set(mine) == set(reference)
    worst = {name: ulp_distance(mine[name], reference[name]) for name in mine}
    if method.startswith("breadcrumbs"):  # float32: equal but where |δ| ties at a cut
        for name in [n for n, d in worst.items() if d]:
            differ = mine[name].view(torch.int32) != reference[name].view(torch.int32)
            tied = tied_at_a_cut(config, name, layers=llama32.num_layers)
            assert not (differ & ~tied).any(), f"{name}: differs beyond tied |δ| at the cuts"
            worst[name] = 0
    assert max(worst.values()) == 0, {n: d for n, d in worst.items() if d}
    manifest = json.loads((ours / "layerswap.json").read_text())
    assert manifest["mergekit_config"] == config
    assert manifest["recipe"]["method"] == method
    assert manifest["recipe"]["arithmetic"] == config["dtype"]  # mergekit's
    if method == "passthrough":
        for out in (ours, theirs):
            assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 8
    assert "Translated from this mergekit config" in (ours / "README.md").read_text()
    assert_forward_pass(ours)


def test_a_sparsifying_config_merges_as_its_recipe_does(
    llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """mergekit's della, translated: the same bytes as the Layerswap recipe it says it is
    (mergekit's own drops are random; test_mergekit_parity.py compares them in distribution),
    the translation's warning in the manifest."""
    m = lambda x: str(getattr(llama, x))  # noqa: E731
    config = {
        "merge_method": "della",
        "base_model": m("base"),
        "models": [
            {"model": m("task"), "parameters": {"weight": 1.0, "density": [0.3, 0.7]}},
            {"model": m("language"), "parameters": {"weight": 0.6, "epsilon": 0.2}},
        ],
        "parameters": {"density": 0.5, "lambda": 1.1},
        "dtype": "bfloat16",
    }
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    recipe = {"method": "della", "base": llama.base, "models": [llama.task, llama.language],
              "params": {"weights": [1.0, 0.6], "density": [[0.3, 0.7], 0.5],
                         "epsilon": [0.15, 0.2], "lambda": 1.1},
              "arithmetic": "bfloat16"}  # fmt: skip
    direct = run_merge(recipe)
    weights = "model.safetensors"
    assert (tmp_path / "ours" / weights).read_bytes() == (direct.out_dir / weights).read_bytes()
    manifest = json.loads((tmp_path / "ours" / "layerswap.json").read_text())
    assert manifest["recipe"]["params"]["seed"] == 0
    assert any("drops are random" in w for w in manifest["warnings"])


@pytest.mark.parametrize("method", ["dare_ties", "dare_linear", "della_linear"])
def test_a_random_sparsifying_config_runs_seeded(
    method: str, llama32: Family, tmp_path: Path
) -> None:
    """mergekit draws DARE's and DELLA's drops unseeded: the translation takes the recipe's
    seed (0), says so, and drops the share of each delta that density asks (one model: an
    entry equals the base's where its delta was dropped)."""
    config = {
        "merge_method": method,
        "base_model": str(llama32.base),
        "models": [{"model": str(llama32.task), "parameters": {"weight": 0.8, "density": 0.3}}],
        "parameters": {"epsilon": 0.1} if method == "della_linear" else {},
        "dtype": "float32",
    }
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "ours" / "layerswap.json").read_text())
    recipe = manifest["recipe"]
    assert (recipe["method"], recipe["base"], recipe["models"]) == (
        method, str(llama32.base), [str(llama32.task)],
    )  # fmt: skip
    params = recipe["params"]
    assert (params["weights"], params["density"], params["seed"]) == ([0.8], [0.3], 0)
    assert (params["rescale"], params["normalize"]) == (True, False)  # mergekit's defaults
    assert any(f"{method}'s drops are random" in w for w in manifest["warnings"])
    name = "model.layers.2.mlp.down_proj.weight"
    merged, base = load(tmp_path / "ours")[name], load(llama32.base)[name]
    kept = float((merged != base).float().mean())
    assert abs(kept - 0.3) < 0.02, kept
    assert_forward_pass(tmp_path / "ours")


def test_arithmetic_float32_on_the_command_line_is_layerswaps_own(
    llama: Family, tmp_path: Path
) -> None:
    """`--arithmetic float32` on a bf16 config: computed in float32 and rounded once, as
    mergekit computes with `dtype: float32` (and out_dtype bf16), and said in a warning."""
    m = lambda x: str(getattr(llama, x))  # noqa: E731
    config = {
        "merge_method": "task_arithmetic",
        "base_model": m("base"),
        "models": [{"model": m("task"), "parameters": {"weight": 0.7}},
                   {"model": m("language"), "parameters": {"weight": 0.4}}],
        "dtype": "bfloat16",
    }  # fmt: skip
    done = merge_config(config, tmp_path, "--arithmetic", "float32")
    assert done.returncode == 0, done.stderr
    assert "warning: arithmetic float32: mergekit computes in bfloat16" in done.stderr
    manifest = json.loads((tmp_path / "ours" / "layerswap.json").read_text())
    assert manifest["recipe"]["arithmetic"] == "float32"
    wide = {**config, "dtype": "float32", "out_dtype": "bfloat16"}
    mine, theirs = load(tmp_path / "ours"), load(run_mergekit(wide, tmp_path / "mergekit"))
    assert max(ulp_distance(mine[n], theirs[n]) for n in mine) == 0


def test_dry_run_shows_the_translated_recipe(
    llama: Family, llama32: Family, tmp_path: Path
) -> None:
    done = merge_config(configs(llama, llama32)["slerp"], tmp_path, "--dry-run")
    assert done.returncode == 0, done.stderr
    header, _, table = done.stdout.partition("\nlayer ")
    shown = yaml.safe_load(header)
    assert shown["method"] == "slerp"
    assert shown["models"] == [str(llama32.task), str(llama32.language)]
    assert shown["params"]["t"][0] == {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]}
    assert table.splitlines()[1].startswith("0 ")  # the plan's per-layer table follows
    assert not (tmp_path / "ours").exists()


# Each case's slices: per slice, each source's first layer and the slice's length (6-layer
# models). linear's weights and slerp's t are gradients: spread over each slice anew, and a
# slice of one layer sits at its end (t = 1), as mergekit places it.
OFFSETS: dict[str, list[tuple[list[int], int]]] = {
    "linear": [([0, 2, 3], 2), ([3, 0, 1], 2)],
    "slerp": [([1, 0], 3), ([0, 2], 2), ([4, 4], 1)],
    "ties": [([0, 3, 1], 3), ([4, 0, 2], 2)],
    "task_arithmetic": [([2, 0, 3, 1], 2), ([0, 4, 1, 3], 2), ([5, 5, 0, 2], 1)],
    "nuslerp": [([0, 1, 2], 3), ([3, 0, 3], 3)],
    "nuslerp-models": [([3, 0], 3)],
    "model_stock": [([0, 1, 2, 3], 3)],
    "karcher": [([2, 0], 4), ([0, 5], 1)],
    "slerp-first-layers": [([0, 0], 4)],  # every model's first 4 of 6 layers: a shallower model
}


def offset_slices(config: dict[str, Any], offsets: list[tuple[list[int], int]]) -> dict[str, Any]:
    """`config`'s models (or its one slice's; a base not among them last) as slices whose
    sources take other layers of each model, their parameters as written."""
    written = config.get("models") or config["slices"][0]["sources"]
    entries = [{k: v for k, v in e.items() if k != "layer_range"} for e in written]
    if config.get("base_model") and all(e["model"] != config["base_model"] for e in entries):
        entries.append({"model": config["base_model"]})
    slices = [{"sources": [{**e, "layer_range": [a, a + n]} for e, a in zip(entries, starts,
                                                                           strict=True)]}
              for starts, n in offsets]  # fmt: skip
    return {key: value for key, value in config.items() if key != "models"} | {"slices": slices}


@pytest.mark.parametrize("case", list(OFFSETS))
def test_slices_of_other_layers_of_each_model_merge_as_mergekit_does(
    case: str, llama: Family, llama32: Family, tmp_path: Path
) -> None:
    """Output layer k of a slice merges layer start+k of each source, the start its own, and
    the slices stack; the non-layer tensors are merged as in a whole-model merge."""
    m32 = lambda x: str(getattr(llama32, x))  # noqa: E731
    karcher = {"merge_method": "karcher", "models": [{"model": m32("task")},
               {"model": m32("language")}], "dtype": "float32"}  # fmt: skip
    written = {**configs(llama, llama32), "karcher": karcher}
    config = offset_slices(written[case.removesuffix("-first-layers")], OFFSETS[case])
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    ours, theirs = tmp_path / "ours", run_mergekit(config, tmp_path / "mergekit")
    mine, reference = load(ours), load(theirs)
    depth = sum(n for _, n in OFFSETS[case])
    assert {layer_of(n) for n in mine} - {None} == set(range(depth))
    assert set(mine) == set(reference)
    worst = {name: ulp_distance(mine[name], reference[name]) for name in mine}
    assert max(worst.values()) == 0, {n: d for n, d in worst.items() if d}
    for out in (ours, theirs):
        assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == depth
    manifest = json.loads((ours / "layerswap.json").read_text())
    assert len(manifest["recipe"]["slices"]) == len(OFFSETS[case])
    assert_forward_pass(ours)


def merged_as_mergekit(config: dict[str, Any], tmp_path: Path) -> None:
    """`layerswap merge` of `config` into tmp_path/ours: every tensor equal to mergekit's, bit
    for bit."""
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    mine, reference = load(tmp_path / "ours"), load(run_mergekit(config, tmp_path / "mergekit"))
    assert set(mine) == set(reference)
    worst = {name: ulp_distance(mine[name], reference[name]) for name in mine}
    assert max(worst.values()) == 0, {n: d for n, d in worst.items() if d}


# Slices that set their parameters each their own way (slice or source parameters), over
# other layers of each model: each slice's layers merged by its own, the tensors before the
# layers by the first slice's and those after them by the last's, as mergekit does.
OWN_PARAMETERS: dict[str, list[dict[str, Any]]] = {
    "slerp": [{"parameters": {"t": [0, 1]}}, {"parameters": {"t": 0.8}}, {}],
    "linear": [{"sources": {0: {"weight": 2.0}}}, {"parameters": {"normalize": False}}],
    "ties": [
        {"sources": {1: {"density": 0.3}}},
        {"parameters": {"lambda": 0.6}, "sources": {2: {"weight": [0.1, 0.9]}}},
    ],
    "task_arithmetic": [{}, {"parameters": {"lambda": 0.5}}, {"sources": {0: {"weight": 2}}}],
}


@pytest.mark.parametrize("case", list(OWN_PARAMETERS))
def test_slices_with_their_own_parameters_merge_as_mergekit_does(
    case: str, llama: Family, llama32: Family, tmp_path: Path
) -> None:
    config = offset_slices(configs(llama, llama32)[case], OFFSETS[case])
    for piece, own in zip(config["slices"], OWN_PARAMETERS[case], strict=True):
        if "parameters" in own:
            piece["parameters"] = own["parameters"]
        for i, parameters in own.get("sources", {}).items():
            source = piece["sources"][i]
            source["parameters"] = {**source.get("parameters", {}), **parameters}
    merged_as_mergekit(config, tmp_path)
    slices = json.loads((tmp_path / "ours" / "layerswap.json").read_text())["recipe"]["slices"]
    assert any("params" in piece for piece in slices)  # merged by more than one set


# A per-model parameter's filter naming a layer, in slices over other layers of each model:
# mergekit matches it against the model's own tensor names (model 0 of linear takes its layer
# 3 at output layer 2; ties' task its layer 4 at output layer 1), a shared one the output's.
LAYER_FILTERS: dict[str, tuple[int, dict[str, Any]]] = {
    "linear": (0, {"weight": [{"filter": "layers.3.", "value": 3.0}, {"value": 1.0}]}),
    "ties": (1, {"density": [{"filter": "layers.4.", "value": 0.2}, {"value": 0.6}]}),
}


@pytest.mark.parametrize("case", list(LAYER_FILTERS))
def test_a_models_filter_naming_a_layer_matches_its_own_layers_as_mergekit_does(
    case: str, llama: Family, llama32: Family, tmp_path: Path
) -> None:
    config = offset_slices(configs(llama, llama32)[case], OFFSETS[case])
    model, parameters = LAYER_FILTERS[case]
    for piece in config["slices"]:
        source = piece["sources"][model]
        source["parameters"] = {**source.get("parameters", {}), **parameters}
    merged_as_mergekit(config, tmp_path)


def other_models(config: dict[str, Any], swaps: dict[int, tuple[int, str]]) -> dict[str, Any]:
    """`config`'s slices with source i of slice s another model (swaps: s -> (i, model))."""
    for s, (i, model) in swaps.items():
        config["slices"][s]["sources"][i] = {**config["slices"][s]["sources"][i], "model": model}
    return config


@pytest.mark.parametrize("case", ["linear", "ties", "task_arithmetic", "slerp", "nuslerp"])
def test_slices_over_other_models_merge_as_mergekit_does(
    case: str, llama: Family, llama32: Family, tmp_path: Path
) -> None:
    """Each slice merges its own sources, the embeddings by the first slice's models and the
    final norm and head by the last's; slerp's and nuslerp's slices each interpolate a pair of
    their own."""
    config = offset_slices(configs(llama, llama32)[case], OFFSETS[case])
    family = llama if case == "linear" else llama32
    other = str(family.language2)
    config = other_models(config, {1: (1, other)} if case != "linear" else {0: (1, other)})
    if case == "slerp":  # a slice that lists the base second: still t = 0, as mergekit's
        config["slices"][2]["sources"].reverse()
    merged_as_mergekit(config, tmp_path)
    manifest = json.loads((tmp_path / "ours" / "layerswap.json").read_text())
    assert other in manifest["recipe"]["models"]


def test_slices_that_thin_deltas_each_their_own_way_are_refused(
    llama: Family, llama32: Family, tmp_path: Path
) -> None:
    """normalize (and dare's rescale) say how the whole merge is made in Layerswap: slices
    that set them otherwise are refused by the slice's field, before any output exists."""
    config = offset_slices(configs(llama, llama32)["breadcrumbs"], [([0, 1, 2], 3)] * 2)
    config["slices"][1]["parameters"] = {"normalize": False}
    done = merge_config(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "layerswap: error [invalid_recipe]: slices.1.parameters: differ from slices.0's in how "
        "deltas are thinned or merged (normalize, rescale, seed), which Layerswap sets once "
        "for the whole merge\n"
    )
    assert not (tmp_path / "ours").exists()


def test_slices_of_unequal_lengths_are_refused_as_mergekit_refuses_them(
    llama32: Family, tmp_path: Path
) -> None:
    config = offset_slices(configs(llama32, llama32)["slerp"], [([1, 0], 5)])
    config["slices"][0]["sources"][1]["layer_range"] = [0, 4]
    done = merge_config(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "layerswap: error [invalid_recipe]: slices.0.sources.1.layer_range: spans 4 layers, "
        "the slice's first source 5: a slice's sources take as many layers each\n"
    )
    config_file = tmp_path / "config.yml"
    theirs = mergekit_reply(config_file, tmp_path / "mergekit")
    assert not theirs["ok"] and "same number of layers" in theirs["error"]


def test_a_slice_past_a_models_layers_is_refused(llama32: Family, tmp_path: Path) -> None:
    config = offset_slices(configs(llama32, llama32)["slerp"], [([1, 3], 4)])
    done = merge_config(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "layerswap: error [invalid_recipe]: slices.0.sources.1.layer_range: [3, 7) is outside "
        f"{llama32.language}, which has 6 layers\n"
    )
    assert not (tmp_path / "ours").exists()


@pytest.fixture(scope="module")
def chats(tmp_path_factory: pytest.TempPathFactory) -> ChatFamily:
    return make_chat_family(tmp_path_factory.mktemp("mergekit-chats"), dtype=torch.float32, seed=3)


def vocabulary_configs(family: ChatFamily) -> dict[str, dict[str, Any]]:
    """chat added four chat tokens, tool a plain token and two special ones (one of them
    chat's): merged over tool or chat (the ids fixed on both sides: the base's, then the
    other's new tokens), and over their base, which lacks every added token (mergekit numbers
    the ones new to it in the order of a set)."""
    chat, tool, base = str(family.chat), str(family.tool), str(family.base)
    return {
        "linear-union": {
            "merge_method": "linear",
            "base_model": tool,  # listed second: the union starts from it all the same
            "models": [{"model": chat, "parameters": {"weight": 0.6}},
                       {"model": tool, "parameters": {"weight": 0.4}}],
            "tokenizer_source": "union",
            "dtype": "float32",
        },
        "slerp-model": {
            "merge_method": "slerp",
            "base_model": tool,
            "models": [{"model": chat}, {"model": tool}],
            "parameters": {"t": [0, 0.3, 1]},
            "tokenizer": {"source": chat},
            "dtype": "float32",
        },
        "task_arithmetic-union": {
            "merge_method": "task_arithmetic",
            "base_model": base,
            "models": [{"model": chat, "parameters": {"weight": 0.7}},
                       {"model": tool, "parameters": {"weight": 0.5}}],
            "tokenizer_source": "union",
            "dtype": "float32",
        },
    }  # fmt: skip


@pytest.mark.parametrize("case", ["linear-union", "slerp-model", "task_arithmetic-union"])
def test_a_tokenizer_source_merges_different_vocabularies_as_mergekit_does(
    case: str, chats: ChatFamily, tmp_path: Path
) -> None:
    config = vocabulary_configs(chats)[case]
    done = merge_config(config, tmp_path)
    assert done.returncode == 0, done.stderr
    ours, theirs = tmp_path / "ours", run_mergekit(config, tmp_path / "mergekit")
    mine, reference = vocabulary(ours), vocabulary(theirs)
    expected = {"linear-union": 262, "slerp-model": 260, "task_arithmetic-union": 262}[case]
    assert len(mine) == expected
    if case == "task_arithmetic-union":  # the base's ids, then the new tokens in any order
        assert set(mine) == set(reference)
        assert {t: i for t, i in mine.items() if i < 256} == {
            t: i for t, i in reference.items() if i < 256
        }
    else:
        assert mine == reference
    mine_t, reference_t = load(ours), load(theirs)
    assert set(mine_t) == set(reference_t)
    order = sorted(mine)
    for name, tensor in mine_t.items():
        if name in embedding_names(mine_t):  # row by token: ids may differ (above)
            rows = reference_t[name][[reference[t] for t in order]]
            assert ulp_distance(tensor[[mine[t] for t in order]], rows) == 0, name
        else:
            assert ulp_distance(tensor, reference_t[name]) == 0, name
    from transformers import AutoTokenizer

    text = "<|im_start|>user zzq <tool> hi<|im_end|>"
    encoded = [AutoTokenizer.from_pretrained(str(d))(text)["input_ids"] for d in (ours, theirs)]
    if case != "task_arithmetic-union":
        assert encoded[0] == encoded[1]
    assert_forward_pass(ours)


def test_a_refusal_is_one_line_naming_the_mergekit_field(
    llama: Family, llama32: Family, tmp_path: Path
) -> None:
    config = configs(llama, llama32)["ties"]
    config["models"][2]["parameters"]["density"] = 0
    done = merge_config(config, tmp_path)
    assert done.returncode == 1
    assert done.stderr == (
        "layerswap: error [invalid_recipe]: models.2.parameters.density: 0.0: must be above 0\n"
    )


def test_the_docs_example_runs_as_written_and_equals_mergekit(tmp_path: Path) -> None:
    """docs/concepts/mergekit.md's command-line block, run verbatim in a fresh directory."""
    page = (Path(__file__).parents[2] / "docs" / "concepts" / "mergekit.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)\n```", page, re.DOTALL)
                 if "layerswap merge" in b)  # fmt: skip
    env = {**os.environ, "PATH": f"{LAYERSWAP.parent}:{os.environ['PATH']}",
           "LAYERSWAP_CACHE_DIR": str(tmp_path / ".cache")}  # fmt: skip
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "method: slerp" in done.stdout  # the dry run showed the translated recipe
    examples = tmp_path / "examples"
    config = yaml.safe_load((examples / "mergekit-slerp.yml").read_text())
    config["base_model"] = str(examples / config["base_model"])
    for source in config["slices"][0]["sources"]:
        source["model"] = str(examples / source["model"])
    ours, theirs = load(examples / "slerped"), load(run_mergekit(config, tmp_path / "mergekit"))
    assert set(ours) == set(theirs)
    assert max(ulp_distance(ours[n], theirs[n]) for n in ours) == 0
    assert_forward_pass(examples / "slerped")
