"""passthrough's `scale`: a native recipe against a reference written from the definition (each
tensor times its scale, in the tensor's dtype), mergekit configs against mergekit-yaml bit for
bit (per-source filters, gradients, a top-level scale, passthrough over one model), and the
refusal of passthrough over two models."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from engine.errors import RecipeError
from engine.mergekit import translate
from engine.planner import make_plan
from engine.recipe import parse_recipe, recipe_to_dict
from tests.conftest import Family
from tests.engine.mergekit_parity import mergekit_reply, run_mergekit
from tests.reference import load

LAYER = re.compile(r"^model\.layers\.(\d+)\.(.*)$")
HEAD = re.compile(r"^(model\.norm|lm_head)\.")
# The pattern published for duplicated layers: their attention output and MLP output zeroed, so
# each adds nothing to the residual stream at first.
ZEROED = [{"filter": "o_proj", "value": 0.0}, {"filter": "down_proj", "value": 0.0}, {"value": 1.0}]


def scale_at(setting: Any, name: str, at: float) -> float | None:
    """A scale for tensor `name` at slice position `at`, from mergekit's documented rules."""
    if isinstance(setting, int | float):
        return float(setting)
    if all(isinstance(v, int | float) for v in setting):
        scaled = at * (len(setting) - 1)
        low = int(scaled)
        high, fraction = min(len(setting) - 1, low + 1), scaled - low
        return (1 - fraction) * setting[low] + fraction * setting[high]
    for condition in setting:
        if condition.get("filter") is None or condition["filter"] in name:
            return scale_at(condition["value"], name, at)
    return None


def scaled(tensor: torch.Tensor, setting: Any, name: str, at: float) -> torch.Tensor:
    value = scale_at(setting, name, at) if setting is not None else None
    return tensor if value is None else tensor * value


def expected(slices: list[tuple[Path, int, int, Any]]) -> dict[str, torch.Tensor]:
    """Output layer k = the k-th listed layer times its scale at (offset in its slice) / (n - 1);
    the embeddings from the first slice, norm and head from the last, each scaled at 0."""
    first, last = load(slices[0][0]), load(slices[-1][0])
    out = {}
    for name in first:
        if not LAYER.match(name):
            model, piece = (last, slices[-1]) if HEAD.search(name) else (first, slices[0])
            out[name] = scaled(model[name], piece[3], name, 0.0)
    k = 0
    for model, start, end, setting in slices:
        tensors = load(model)
        for offset, j in enumerate(range(start, end)):
            at = offset / (end - start - 1) if end - start > 1 else 1.0
            for name, tensor in tensors.items():
                if (m := LAYER.match(name)) and int(m.group(1)) == j:
                    out[f"model.layers.{k}.{m.group(2)}"] = scaled(tensor, setting, name, at)
            k += 1
    return out


def assert_same_bits(actual: dict[str, torch.Tensor], wanted: dict[str, torch.Tensor]) -> None:
    """Every bit equal, the sign of a zero included (x · 0 of a negative x is −0)."""
    assert set(actual) == set(wanted)
    for name, tensor in wanted.items():
        got = actual[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
        bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
        assert torch.equal(got.view(bits[got.dtype]), tensor.view(bits[got.dtype])), name


def native(slices: list[tuple[Path, int, int, Any]]) -> dict[str, Any]:
    sources = [{"model": str(m), "layer_range": [a, b]} | ({"scale": s} if s is not None else {})
               for m, a, b, s in slices]  # fmt: skip
    return {
        "method": "passthrough",
        "models": list(dict.fromkeys(str(m) for m, *_ in slices)),
        "params": {"slices": [{"sources": [source]} for source in sources]},
    }


def test_native_scales_are_the_tensors_times_their_scale(llama: Family, run_merge: Any) -> None:
    """Filters, a gradient with a non-representable 0.3 and a scale of 0; the unscaled tensors
    stay copies, the scaled ones are computed."""
    slices = [
        (llama.task, 0, 3, ZEROED),
        (llama.language, 2, 6, [0.5, 0.3, 1.0]),
        (llama.task, 5, 6, None),
        (llama.language, 1, 2, [{"filter": "mlp", "value": 0.3}]),
    ]
    recipe = native(slices)
    plan = make_plan(parse_recipe(recipe), resolve=Path, headers_only=True)
    plan.close()
    ops = {t.name: (t.op, t.terms[0].coefficient) for t in plan.tensors}
    assert ops["model.layers.0.self_attn.o_proj.weight"] == ("linear", 0.0)
    assert ops["model.layers.0.self_attn.q_proj.weight"] == ("copy", 1.0)
    assert ops["model.layers.3.mlp.up_proj.weight"] == ("linear", 0.5)
    assert ops["model.layers.7.mlp.up_proj.weight"] == ("copy", 1.0)
    assert ops["model.layers.8.mlp.up_proj.weight"] == ("linear", 0.3)
    assert ops["model.layers.8.self_attn.q_proj.weight"] == ("copy", 1.0)  # no filter matches
    assert ops["model.embed_tokens.weight"] == ("copy", 1.0)
    result = run_merge(recipe)
    wanted = expected(slices)
    assert (wanted["model.layers.0.mlp.down_proj.weight"] == 0).all()
    assert_same_bits(load(result.out_dir), wanted)


def test_one_model_without_slices_is_copied_whole_and_scaled(llama: Family, run_merge: Any) -> None:
    scale = [{"filter": "self_attn", "value": [1.0, 0.0]}, {"filter": "lm_head", "value": 0.5}]
    recipe = {"method": "passthrough", "models": [str(llama.language)], "params": {"scale": scale}}
    result = run_merge(recipe)
    assert_same_bits(load(result.out_dir), expected([(llama.language, 0, 6, scale)]))


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"method": "passthrough", "models": ["a", "b"], "params": {}}, "models"),
        (
            {"method": "passthrough", "models": ["a"], "params": {"scale": 0.5, "slices": [
                {"sources": [{"model": "a", "layer_range": [0, 1]}]}]}},
            "params.scale",
        ),
        (
            {"method": "passthrough", "models": ["a"], "params": {"slices": [{"sources": [
                {"model": "a", "layer_range": [0, 1], "scale": "half"}]}]}},
            "params.slices.0.sources.0.scale",
        ),
    ],
    ids=["two-models-unsliced", "scale-beside-slices", "not-a-number"],
)  # fmt: skip
def test_invalid_scales_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe(recipe)
    assert error.value.details["field"].startswith(field), error.value


def test_an_unscaled_recipe_dumps_as_before(llama: Family) -> None:
    recipe = native([(llama.task, 0, 2, None)])
    assert recipe_to_dict(parse_recipe(recipe))["params"] == recipe["params"]


# -- against mergekit -----------------------------------------------------------------------------
def ours(config: dict[str, Any], run_merge: Any) -> Path:
    translated = translate(config, is_local=lambda source: Path(source).exists())
    return Path(run_merge(recipe_to_dict(translated.recipe)).out_dir)


def sliced_config(fam: Family, dtype: str) -> dict[str, Any]:
    """Per-source filters zeroing o_proj and down_proj (and one matching the input layer 3,
    output layer 5), a slice's gradient (its norm and head scaled at 0), and a top-level scale
    for the rest."""
    return {
        "merge_method": "passthrough",
        "slices": [
            {"sources": [{"model": str(fam.task), "layer_range": [0, 4]}]},
            {"sources": [{"model": str(fam.language), "layer_range": [2, 6],
                          "parameters": {"scale": [{"filter": "layers.3.", "value": 0.7},
                                                   *ZEROED]}}]},
            {"sources": [{"model": str(fam.task), "layer_range": [3, 6]}],
             "parameters": {"scale": [0.5, 0.3, 1.7]}},
        ],
        "parameters": {"scale": 0.3},
        "dtype": dtype,
    }  # fmt: skip


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_scaled_slices_equal_mergekit(
    dtype: str, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    config = sliced_config(llama, dtype)
    mine = load(ours(config, run_merge))
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    assert_same_bits(mine, theirs)
    # the scales did act: zeroed projections, the embeddings at 0.3
    assert (mine["model.layers.4.self_attn.o_proj.weight"] == 0).all()
    assert not (mine["model.layers.5.self_attn.o_proj.weight"] == 0).all()  # 0.7: input layer 3
    embed = mine["model.embed_tokens.weight"]
    assert not torch.equal(embed, load(llama.task)["model.embed_tokens.weight"].to(embed.dtype))


@pytest.mark.parametrize("with_base", [False, True], ids=["no-base", "itself-the-base"])
def test_scaled_passthrough_over_one_model_equals_mergekit(
    with_base: bool, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    config: dict[str, Any] = {
        "merge_method": "passthrough",
        "models": [{"model": str(llama.language),
                    "parameters": {"scale": [{"filter": "mlp", "value": [0.0, 0.5, 1.3]},
                                             {"filter": "layers", "value": 0.3}]}}],
        "parameters": {"scale": 0.5},
        "dtype": "bfloat16",
    }  # fmt: skip
    if with_base:  # mergekit's base_model among the models: still the one input
        config["base_model"] = str(llama.language)
    translated = translate(config, is_local=lambda source: Path(source).exists())
    assert "slices" not in recipe_to_dict(translated.recipe)["params"]
    mine = load(ours(config, run_merge))
    assert_same_bits(mine, load(run_mergekit(config, tmp_path / "mergekit")))


def test_passthrough_over_two_models_is_refused_as_mergekit_refuses_it(
    llama: Family, tmp_path: Path
) -> None:
    config = {
        "merge_method": "passthrough",
        "models": [{"model": str(llama.task)}, {"model": str(llama.language)}],
        "dtype": "bfloat16",
    }
    with pytest.raises(RecipeError) as error:
        translate(config, is_local=lambda source: Path(source).exists())
    assert error.value.details["field"] == "models"
    assert "exactly one" in str(error.value)
    config_file = tmp_path / "two.yml"
    config_file.write_text(yaml.safe_dump(config))
    reply = mergekit_reply(config_file, tmp_path / "mergekit")
    assert not reply["ok"] and "exactly 1 inputs" in reply["error"]
