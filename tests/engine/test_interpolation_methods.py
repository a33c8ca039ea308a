"""linear and slerp against plain-torch references written from their formulas, a forward
pass of an output, and the recipe errors that name their field."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.errors import RecipeError
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.engine.test_output import assert_forward_pass
from tests.reference import accumulation_slack, assert_within_ulps, load


def _slerp(t: float, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Textbook slerp in float64 over the flattened tensors (lerp when nearly collinear)."""
    x, y = a.double().flatten(), b.double().flatten()
    cos = float(torch.dot(x / x.norm(), y / y.norm()).clamp(-1, 1))
    if abs(cos) > 0.9995:
        return ((1 - t) * x + t * y).view(a.shape)
    theta = math.acos(cos)
    out = (math.sin((1 - t) * theta) * x + math.sin(t * theta) * y) / math.sin(theta)
    return out.view(a.shape)


def test_linear_matches_weighted_sum(llama32: Family, run_merge: Any) -> None:
    paths = [llama32.task, llama32.language]
    weights = [0.25, [1.0, 3.0]]  # the second model's weight rises from 1 to 3 across layers
    result = run_merge(
        {"method": "linear", "models": paths, "params": {"weights": weights, "normalize": True}}
    )
    a, b = (load(p) for p in paths)
    out = load(result.out_dir)
    for name, tensor in out.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        w = 1.0 + 2.0 * (layer / 5 if layer is not None else 0.0)
        expected = (0.25 * a[name].double() + w * b[name].double()) / (0.25 + w)
        slack = accumulation_slack([0.25 / (0.25 + w), w / (0.25 + w)], [a[name], b[name]])
        assert_within_ulps(tensor, expected.float(), ulps=2, name=name, slack=slack)


def test_slerp_matches_formula_and_runs(llama32: Family, run_merge: Any) -> None:
    t = [0.0, 0.5, 1.0]
    result = run_merge(
        {"method": "slerp", "models": [llama32.base, llama32.language], "params": {"t": t}}
    )
    a, b = load(llama32.base), load(llama32.language)
    out = load(result.out_dir)
    for name, tensor in out.items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else None
        at = layer / 5 if layer is not None else 0.0
        expected = _slerp(at, a[name], b[name]).float()
        slack = accumulation_slack([1.0, 1.0], [a[name], b[name]])  # |coefficients| ≤ ~1
        assert_within_ulps(tensor, expected, ulps=4, name=name, slack=slack)
    assert torch.equal(out["model.embed_tokens.weight"], a["model.embed_tokens.weight"])
    assert_forward_pass(result.out_dir)


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        (
            {"method": "linear", "models": ["a", "b"], "params": {"weights": "half"}},
            "params.weights",
        ),
        ({"method": "linear", "models": ["a", "b"], "params": {"weights": [1]}}, "params.weights"),
        ({"method": "slerp", "models": ["a", "b", "c"], "params": {"t": 0.5}}, "models"),
        ({"method": "slerp", "models": ["a", "b"], "params": {"t": "half"}}, "params.t"),
        ({"method": "slerp", "models": ["a", "b"], "params": {"t": [{"filte": "x"}]}}, "params.t"),
    ],
    ids=["linear-weights", "linear-count", "slerp-three", "slerp-t", "slerp-condition"],
)
def test_invalid_recipes_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe(recipe)
    assert error.value.details["field"] == field, error.value


def test_unmatched_filter_is_refused_at_plan_time(llama32: Family, run_merge: Any) -> None:
    recipe = {
        "method": "slerp",
        "models": [llama32.task, llama32.language],
        "params": {"t": [{"filter": "mlp", "value": 0.5}]},
    }
    with pytest.raises(RecipeError, match=r"params\.t: no filter matches"):
        run_merge(recipe)
