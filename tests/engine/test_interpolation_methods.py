"""linear and slerp against plain-torch references written from their formulas, a forward
pass of an output, and the recipe errors that name their field."""

from __future__ import annotations

import math
from pathlib import Path
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


def _slerp_in_spans(t: float, a: torch.Tensor, b: torch.Tensor, span: int) -> torch.Tensor:
    """The engine's slerp of one tensor, bit for bit: in float32 (the inputs' float64 for F64);
    each norm is the norm of the norms of the flattened tensor's `span`-element pieces, the
    dot the sum of the pieces' dots of the vectors divided by their norms; lerp when nearly
    collinear; out = coef_a·a + coef_b·b (two products, one sum), rounded once."""
    wide = torch.float64 if a.dtype == torch.float64 else torch.float32
    x, y = a.to(wide).view(1, -1), b.to(wide).view(1, -1)
    pieces = [(s, min(span, x.numel() - s)) for s in range(0, x.numel(), span)]

    def norm(v: torch.Tensor) -> torch.Tensor:
        parts = [torch.linalg.vector_norm(v[:, s : s + n], dim=1, keepdim=True) for s, n in pieces]
        total = torch.linalg.vector_norm(torch.stack(parts), dim=0)
        return torch.where(total > 1e-8, total, 1)

    nx, ny = norm(x), norm(y)
    dots = [((x[:, s : s + n] / nx) * (y[:, s : s + n] / ny)).sum(dim=1, keepdim=True)
            for s, n in pieces]  # fmt: skip
    dot = torch.stack(dots).sum(dim=0).clamp(-1, 1)
    tt = torch.tensor([[t]], dtype=wide)
    if abs(float(dot)) > 0.9995:
        coef_x, coef_y = 1 - tt, tt
    else:
        theta = torch.acos(dot)
        coef_x = torch.sin((1 - tt) * theta) / torch.sin(theta)
        coef_y = torch.sin(tt * theta) / torch.sin(theta)
    return (x * coef_x + y * coef_y).view(a.shape).to(a.dtype)


@pytest.fixture(scope="module")
def apart(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per dtype, a Llama and a copy with noise of a fifth of each tensor's std: most tensors
    are far enough apart for slerp proper and near enough that the last bits of their dot
    (so the pieces it is summed in) show in the output."""
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("apart")
    pairs = {}
    for name, dtype in (("bf16", torch.bfloat16), ("f32", torch.float32)):
        first = make_checkpoint(root / f"{name}-first", layers=2, dtype=dtype, seed=31)
        second = make_checkpoint(root / f"{name}-second", base=first, dtype=dtype, seed=32,
                                 layer_scale=[0.2, 0.2], non_layer_scale=1.0)  # fmt: skip
        pairs[name] = (first, second)
    return pairs


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
@pytest.mark.parametrize("chunk_elements", [1000, 1024, 4096])
def test_slerp_in_chunks_equals_reference(
    dtype: str, chunk_elements: int, apart: dict[str, tuple[Path, Path]], run_merge: Any
) -> None:
    """Every chunk size gives the same bits as the reference in pieces of a chunk, whether a
    tensor is kept between slerp's passes (up to 8 chunks) or read again for each."""
    first, second = apart[dtype]
    recipe = {"method": "slerp", "models": [first, second], "params": {"t": 0.3}}
    result = run_merge(recipe, chunk_elements=chunk_elements)
    a, b, out = load(first), load(second), load(result.out_dir)
    sizes = sorted(t.numel() for t in out.values())
    assert sizes[-1] > 8 * chunk_elements or chunk_elements == 4096  # read again per pass
    assert any(chunk_elements < n <= 8 * chunk_elements for n in sizes)  # kept, several pieces
    for name, tensor in out.items():
        assert torch.equal(tensor, _slerp_in_spans(0.3, a[name], b[name], chunk_elements)), name


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
        (
            {"method": "slerp", "models": ["a", "b"], "params": {"t": [{"filte": "x"}]}},
            "params.t.0.value",
        ),  # the condition's, not "t should be a number"
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
