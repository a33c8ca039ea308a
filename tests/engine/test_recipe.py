"""Recipe validation: every invalid recipe is a RecipeError whose message names the field."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from engine.errors import RecipeError
from engine.methods.layer_swap import LayerSwapRecipe
from engine.methods.soup import SoupRecipe
from engine.methods.ties import TiesRecipe
from engine.recipe import parse_recipe, parse_size, recipe_to_dict, slice_recipes
from tests.conftest import Family
from tests.helpers import leftovers

EXPERTS = {"task": ["./math"], "language": ["./swh"]}
SWAP = {"method": "layer_swap", "experts": EXPERTS}
SOUP = {"method": "soup", "models": ["./a", "./b"]}
TIES = {"method": "ties", "base": "./base", "models": ["./a", "./b"]}
ARITHMETIC = {"method": "task_arithmetic", "base": "./base", "models": ["./a", "./b"]}
SLICE = {"sources": [{"model": m, "layer_range": [0, 2]} for m in ("./a", "./b")]}
TIES_SLICE = {"sources": [*SLICE["sources"], {"model": "./base", "layer_range": [0, 2]}]}

INVALID: dict[str, tuple[Any, str]] = {
    "unknown-param": ({**SWAP, "params": {"bottom": 1, "foo": 2}}, "params.foo"),
    "unknown-top-level": ({**SOUP, "extra": True}, "extra"),
    "unknown-output-key": (
        {**SOUP, "output": {"dtype": "source", "compress": 1}},
        "output.compress",
    ),
    "ties-param-in-soup": ({**SOUP, "params": {"density": 0.5}}, "params.density"),
    "unknown-method": ({**SOUP, "method": "dare"}, "method"),
    "missing-method": ({"models": ["./a", "./b"]}, "method"),
    "non-mapping-list": (["method", "soup"], "recipe"),
    "non-mapping-str": ("layer_swap", "recipe"),
    "non-mapping-none": (None, "recipe"),
    "magnitude-transition-no-base": (
        {**SWAP, "params": {"transition_weights": "magnitude"}},
        "base",
    ),
    "magnitude-expert-soup-no-base": ({**SWAP, "params": {"expert_soup": "magnitude"}}, "base"),
    "magnitude-soup-no-base": ({**SOUP, "params": {"weights": "magnitude"}}, "base"),
    "task-arithmetic-no-base": ({k: v for k, v in ARITHMETIC.items() if k != "base"}, "base"),
    "ties-no-base": ({k: v for k, v in TIES.items() if k != "base"}, "base"),
    "soup-weights-sum-zero": ({**SOUP, "params": {"weights": [1.0, -1.0]}}, "params.weights"),
    "arithmetic-weights-count": ({**ARITHMETIC, "params": {"weights": [0.5]}}, "params.weights"),
    "ties-density-above-one": (
        {**TIES, "params": {"density": [0.5, [1, 1.5]]}},
        "params.density.1",
    ),
    "soup-weights-length": ({**SOUP, "params": {"weights": [1, 2, 3]}}, "params.weights"),
    "ties-weights-length": ({**TIES, "params": {"weights": [1]}}, "params.weights"),
    "density-zero": ({**TIES, "params": {"density": 0}}, "params.density"),
    "density-above-one": ({**TIES, "params": {"density": 1.5}}, "params.density"),
    "density-negative": ({**TIES, "params": {"density": -0.1}}, "params.density"),
    "lambda-nan": ({**ARITHMETIC, "params": {"lambda": float("nan")}}, "params.lambda"),
    "negative-bottom": ({**SWAP, "params": {"bottom": -1}}, "params.bottom"),
    "bottom-not-int": ({**SWAP, "params": {"bottom": 1.5}}, "params.bottom"),
    "non-layer-choice": ({**SWAP, "params": {"non_layer": "both"}}, "params.non_layer"),
    "transition-weights-both-zero": (
        {**SWAP, "params": {"transition_weights": {"task": 0, "language": 0}}},
        "params.transition_weights",
    ),
    "transition-weights-negative": (
        {**SWAP, "params": {"transition_weights": {"task": -1, "language": 2}}},
        "params.transition_weights",
    ),
    "no-task-experts": ({**SWAP, "experts": {"task": [], "language": ["./b"]}}, "experts.task"),
    "missing-language-role": ({**SWAP, "experts": {"task": ["./a"]}}, "experts.language"),
    "soup-one-model": ({**SOUP, "models": ["./a"]}, "models"),
    "empty-source": ({**SOUP, "models": ["./a", ""]}, "models.1"),
    "output-dtype": ({**SOUP, "output": {"dtype": "int8"}}, "output.dtype"),
    "shard-size-garbage": ({**SOUP, "output": {"shard_size": "lots"}}, "output.shard_size"),
    "shard-size-tiny": ({**SOUP, "output": {"shard_size": "10B"}}, "output.shard_size"),
    "slice-unknown-source": (
        {**SOUP, "slices": [{"sources": [{"model": "./c", "layer_range": [0, 2]}]}]},
        "slices.0.sources",
    ),
    "slice-without-base": ({**TIES, "slices": [SLICE]}, "slices.0.sources"),
    "model-in-no-slice": (
        {**SOUP, "models": ["./a", "./b", "./c"], "slices": [SLICE]},
        "models.2",
    ),
    "slice-param-unknown": (
        {**SOUP, "slices": [SLICE, {**SLICE, "params": {"density": 0.5}}]},
        "slices.1.params.density",
    ),
    "slice-weights-length": (
        {**SOUP, "slices": [{**SLICE, "params": {"weights": [1, 2, 3]}}]},
        "slices.0.params.weights",
    ),
    "slice-density-above-one": (
        {**TIES, "slices": [{**TIES_SLICE, "params": {"density": 2}}]},
        "slices.0.params.density",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_recipe_names_the_field(case: str) -> None:
    data, field = INVALID[case]
    with pytest.raises(RecipeError) as info:
        parse_recipe(data)
    error = info.value
    assert error.code == "invalid_recipe"
    assert error.details["field"].startswith(field)
    assert error.message.startswith(field)
    assert "\n" not in error.message


def test_valid_recipes_and_defaults() -> None:
    swap = parse_recipe(dict(SWAP))
    assert isinstance(swap, LayerSwapRecipe)
    assert (swap.params.bottom, swap.params.top) == (5, 2)
    assert (swap.params.bottom_transition, swap.params.top_transition) == (0, 0)
    assert swap.params.transition_weights == "uniform"
    assert swap.params.non_layer == "average"
    assert swap.params.expert_soup == "uniform"
    assert swap.output.dtype == "source"
    assert swap.output.shard_bytes == 2_000_000_000

    ties = parse_recipe({**TIES, "params": {"density": 1.0, "lambda": 0.5, "normalize": False}})
    assert isinstance(ties, TiesRecipe)
    assert (ties.params.density, ties.params.lambda_, ties.params.normalize) == (1.0, 0.5, False)
    # `lambda` round-trips under its YAML name
    assert recipe_to_dict(ties)["params"]["lambda"] == 0.5
    assert parse_recipe(recipe_to_dict(ties)) == ties

    explicit = parse_recipe(
        {**SWAP, "params": {"transition_weights": {"task": 0.7, "language": 0.3}}}
    )
    assert explicit.params.transition_weights.task == 0.7  # type: ignore[union-attr]
    extrapolating = parse_recipe({**SOUP, "params": {"weights": [2, -1]}})
    assert isinstance(extrapolating, SoupRecipe)
    assert extrapolating.params.weights == [2, -1]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("5GB", 5 * 10**9),
        ("500MB", 500 * 10**6),
        ("1GiB", 2**30),
        ("40KB", 40_000),
        ("1.5 GB", 1_500_000_000),
        (4096, 4096),
    ],
)
def test_parse_size(text: Any, size: int) -> None:
    assert parse_size(text) == size


def test_layer_budget_exceeded_names_params(llama: Family, run_merge: Any, tmp_path: Path) -> None:
    """b + t_b + t_u + u > L needs the checkpoints: checked when planning, before any output."""
    out = tmp_path / "too-many-layers"
    with pytest.raises(RecipeError) as info:
        run_merge(
            {
                "method": "layer_swap",
                "experts": {"task": [llama.task], "language": [llama.language]},
                "params": {"bottom": 2, "bottom_transition": 2, "top_transition": 1, "top": 2},
            },
            out,
        )
    assert info.value.code == "invalid_recipe"
    assert info.value.details["field"] == "params"
    assert info.value.message.startswith("params")
    assert "7" in info.value.message
    assert leftovers(out) == []


def test_budget_exactly_full_is_allowed(llama: Family, run_merge: Any) -> None:
    result = run_merge(
        {
            "method": "layer_swap",
            "experts": {"task": [llama.task], "language": [llama.language]},
            "params": {"bottom": 2, "bottom_transition": 1, "top_transition": 1, "top": 2},
        }
    )
    origins = [row["origin"] for row in result.manifest["layers"]]
    assert "task" not in origins[:6]


def test_errors_survive_pickling() -> None:
    """Errors cross process/Celery boundaries with their code and details intact."""
    with pytest.raises(RecipeError) as info:
        parse_recipe({**SWAP, "params": {"foo": 1}})
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is RecipeError
    assert clone.to_dict() == info.value.to_dict()
    assert clone.to_dict()["code"] == "invalid_recipe"


def test_a_slice_without_params_is_written_as_before_and_one_with_them_keeps_them() -> None:
    plain = recipe_to_dict(parse_recipe({**SOUP, "slices": [SLICE]}))
    assert plain["slices"] == [SLICE]  # digests of recipes written before slices had params
    own = parse_recipe({**SOUP, "slices": [SLICE, {**SLICE, "params": {"weights": [1, 3]}}]})
    assert recipe_to_dict(own)["slices"][1]["params"] == {"weights": [1, 3]}


def pair(first: str, second: str) -> dict[str, Any]:
    return {"sources": [{"model": m, "layer_range": [0, 2]} for m in (first, second)]}


@pytest.mark.parametrize("method", ["slerp", "nuslerp"])
def test_a_method_of_two_models_takes_two_or_a_pair_per_slice(method: str) -> None:
    three = {"method": method, "models": ["./a", "./b", "./c"]}
    with pytest.raises(RecipeError) as info:
        parse_recipe(three)
    assert info.value.details["field"] == "models"
    assert info.value.message.startswith(f"models: models lists 3: {method} merges 2 models")
    paired = parse_recipe({**three, "slices": [pair("./a", "./b"), pair("./c", "./a")]})
    # slerp's t = 0 is the model listed first in `models`; nuslerp's weights follow the slice
    expected = [["./a", "./b"], ["./a", "./c"] if method == "slerp" else ["./c", "./a"]]
    assert [r.models for r in slice_recipes(paired)] == expected
    with pytest.raises(RecipeError) as info:
        wide = pair("./a", "./b")["sources"] + [{"model": "./c", "layer_range": [0, 2]}]
        parse_recipe({**three, "slices": [pair("./a", "./b"), {"sources": wide}]})
    assert info.value.details["field"] == "slices.1.sources"
    assert info.value.message.endswith(f"names 3 models besides any base: {method} merges 2")
