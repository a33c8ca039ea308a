"""ram and ramplus_tl: against a float64 reference written here from the formula in
engine/methods/ram.py's docstring (tensors read whole and in pieces), against mergekit 0.1.5
bit for bit, and the errors that name their field.

The test experts change every entry by about 1e-3 of it or less (bf16 rounds many changes to
zero), so an epsilon of that order splits the entries between one model, several and none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import RecipeError
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.engine.mergekit_parity import run_mergekit, translated_merge, ulp_distance
from tests.reference import layer_of, load

SMALL_CHUNK = 1000  # every 2-D weight of the test models is larger: read in pieces
NAMES = ["task", "language", "task2"]


def ram(
    base: torch.Tensor, models: list[torch.Tensor], epsilon: float,
    r: float | None = None, alpha: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """The formula, in float64: unique entries whole (× λᵢ), shared ones ÷ their count."""
    deltas = torch.stack([m.double() - base.double() for m in models])
    part = deltas.abs() > epsilon
    count = part.sum(dim=0)
    unique, shared = part & (count == 1), part & (count > 1)
    scale = torch.ones(len(models), dtype=torch.float64)
    if r is not None and alpha is not None:
        per_model = [
            (shared[i].sum() / max(int(unique[i].sum()), epsilon)) for i in range(len(models))
        ]
        scale = 1 + r * torch.tensor([float(x) for x in per_model]).clamp(0, alpha)
    view = scale.view(-1, *([1] * base.dim()))
    merged = (deltas * unique * view).sum(dim=0) + (deltas * shared / count.clamp(min=1)).sum(dim=0)
    return base.double() + merged


@pytest.mark.parametrize("chunk", [None, SMALL_CHUNK], ids=["whole", "pieces"])
@pytest.mark.parametrize(
    ("method", "params"),
    [("ram", {}), ("ram", {"epsilon": 5e-4}),
     ("ramplus_tl", {"epsilon": 5e-4}), ("ramplus_tl", {"epsilon": 2e-4, "r": 0.5, "alpha": 1.5})],
    ids=["ram", "ram-eps", "ramplus", "ramplus-r-alpha"],
)  # fmt: skip
def test_matches_formula(
    method: str, params: dict[str, float], chunk: int | None, llama32: Family, run_merge: Any
) -> None:
    recipe = {"method": method, "base": llama32.base,
              "models": [getattr(llama32, n) for n in NAMES], "params": params}  # fmt: skip
    out = load(run_merge(recipe, **({"chunk_elements": chunk} if chunk else {})).out_dir)
    base, models = load(llama32.base), [load(getattr(llama32, n)) for n in NAMES]
    epsilon = params.get("epsilon", 1e-5)
    r, alpha = (
        (params.get("r", 0.1), params.get("alpha", 0.2)) if method == "ramplus_tl" else (None, None)
    )
    split = False
    for name, actual in out.items():
        expected = ram(base[name], [m[name] for m in models], epsilon, r, alpha)
        scale = float(expected.abs().max())
        assert float((actual.double() - expected).abs().max()) <= 1e-6 * scale, name
        count = sum(((m[name] - base[name]).abs() > epsilon).int() for m in models)
        split |= bool((count == 1).any()) and bool((count > 1).any())
    assert split, "no tensor has both unique and shared entries: the test shows nothing"


def test_a_gradient_epsilon_varies_by_layer(llama32: Family, run_merge: Any) -> None:
    recipe = {"method": "ram", "base": llama32.base, "models": [llama32.task, llama32.language],
              "params": {"epsilon": [0.0, 1e-3]}}  # fmt: skip
    out = load(run_merge(recipe).out_dir)
    base, models = load(llama32.base), [load(llama32.task), load(llama32.language)]
    layers = llama32.num_layers
    for name, actual in out.items():
        layer = layer_of(name)
        if layer is None:
            continue
        epsilon = 1e-3 * layer / (layers - 1)
        expected = ram(base[name], [m[name] for m in models], epsilon)
        assert float((actual.double() - expected).abs().max()) <= 1e-6 * float(expected.abs().max())


CASES = {
    "ram-defaults": ("ram", {}),
    "ram-gradient": ("ram", {"epsilon": [1e-5, 1e-3]}),
    "ramplus-defaults": ("ramplus_tl", {}),
    "ramplus-filters": ("ramplus_tl", {"epsilon": 5e-4, "r": [{"filter": "mlp", "value": 0.4},
                                                             {"value": 0.1}], "alpha": 0.5}),
}  # fmt: skip


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bfloat16-as-written"])
@pytest.mark.parametrize("case", list(CASES))
def test_equals_mergekit(
    case: str, dtype: str, llama: Family, llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """float32 checkpoints in float32; bf16 ones in mergekit's bf16 arithmetic, with out_dtype
    and without (ramplus_tl's float32 λ makes mergekit's result float32, written so)."""
    family = llama32 if dtype == "float32" else llama
    method, params = CASES[case]
    config = {"merge_method": method, "base_model": str(family.base),
              "models": [{"model": str(getattr(family, n))} for n in NAMES],
              "parameters": params, "dtype": dtype.removesuffix("-as-written")}  # fmt: skip
    if not dtype.endswith("-as-written"):
        config["out_dtype"] = config["dtype"]
    ours, theirs = (
        load(translated_merge(config, run_merge)),
        load(run_mergekit(config, tmp_path / "mk")),
    )
    assert set(ours) == set(theirs)
    assert {n: t.dtype for n, t in ours.items()} == {n: t.dtype for n, t in theirs.items()}
    assert max(ulp_distance(ours[n], theirs[n]) for n in ours) == 0
    assert any(not torch.equal(ours[n], load(family.base)[n]) for n in ours)


@pytest.mark.parametrize(
    ("recipe", "field"),
    [({"method": "ram", "base": "b", "models": ["a"], "params": {"epsilon": -1}}, "params"),
     ({"method": "ramplus_tl", "base": "b", "models": ["a"], "params": {"alpha": -0.1}}, "params"),
     ({"method": "ram", "models": ["a"]}, "base"),
     ({"method": "ram", "base": "b", "models": ["a"], "params": {"r": 0.1}}, "params.r")],
    ids=["negative-epsilon", "negative-alpha", "no-base", "ram-has-no-r"],
)  # fmt: skip
def test_invalid_recipes_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as raised:
        parse_recipe(recipe)
    assert field in str(raised.value)
