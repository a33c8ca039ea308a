"""linear, slerp, passthrough and the sparsifying methods against mergekit 0.1.5 on the same
checkpoints, every tensor compared.

mergekit runs in .venv-bench (bench/setup.sh). For linear and slerp, with dtype = out_dtype =
the checkpoints' own, so both sides widen to float32, compute and round once. Expected: equal
bits; at most 1 ulp where a reduction (slerp's norms and dot) may sum in another order. The
sparsifying methods: see their section below.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.engine.mergekit_parity import (
    family_config,
    run_mergekit,
    translated_merge,
    worst_ulps,
)
from tests.engine.sparsify_reference import gradient, setting_value, tie_ambiguous
from tests.reference import assert_within_ulps, layer_of, load

GRADIENT_T = [
    {"filter": "self_attn", "value": [0, 0.5, 0.3, 0.7, 1]},
    {"filter": "mlp", "value": [1, 0.5, 0.7, 0.3, 0]},
    {"value": 0.5},
]


@pytest.fixture(scope="module")
def unrelated(tmp_path_factory: pytest.TempPathFactory, llama32: Family) -> Path:
    """A float32 Llama initialised apart from llama32: about 90° from it, far from lerp."""
    from worker.examples import make_checkpoint

    return make_checkpoint(
        tmp_path_factory.mktemp("unrelated") / "model", arch="llama", layers=6,
        dtype=torch.float32, seed=77,
    )  # fmt: skip


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("weights", "normalize"),
    [([0.3, 0.6, 0.45], True), ([0.7, -0.2, 0.5], False), ([[1, 0, 2], 0.5, [0.1, 1]], True)],
    ids=["normalize", "sum", "gradients"],
)
def test_linear_equals_mergekit(
    family_name: str,
    weights: list[Any],
    normalize: bool,
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    names = ["task", "language", "task2"]
    recipe = {
        "method": "linear",
        "models": [getattr(fam, m) for m in names],
        "params": {"weights": weights, "normalize": normalize},
    }
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    config = family_config(
        "linear",
        fam,
        [(m, {"weight": w}) for m, w in zip(names, weights, strict=True)],
        dtype,
        dtype=dtype,
        parameters={"normalize": normalize},
    )
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("t", "pair"),
    [(0.3, ("task", "language")), ([0, 0.5, 1], ("base", "language")),
     (GRADIENT_T, ("task", "language"))],
    ids=["scalar", "gradient", "filters"],
)  # fmt: skip
def test_slerp_equals_mergekit(
    family_name: str,
    t: Any,
    pair: tuple[str, str],
    request: pytest.FixtureRequest,
    run_merge: Any,
    tmp_path: Path,
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    recipe = {"method": "slerp", "models": [getattr(fam, m) for m in pair], "params": {"t": t}}
    ours = run_merge(recipe).out_dir
    dtype = "bfloat16" if family_name == "llama" else "float32"
    config = family_config(
        "slerp",
        fam,
        [(pair[0], {}), (pair[1], {})],
        dtype,
        dtype=dtype,
        base_model=str(getattr(fam, pair[0])),
        parameters={"t": t},
    )
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1


def test_slerp_far_apart_equals_mergekit(
    llama32: Family, unrelated: Path, run_merge: Any, tmp_path: Path
) -> None:
    recipe = {"method": "slerp", "models": [llama32.base, unrelated], "params": {"t": GRADIENT_T}}
    ours = run_merge(recipe).out_dir
    config = {
        "merge_method": "slerp",
        "models": [{"model": str(llama32.base)}, {"model": str(unrelated)}],
        "base_model": str(llama32.base),
        "parameters": {"t": GRADIENT_T},
        "dtype": "float32",
        "out_dtype": "float32",
    }
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) <= 1


def _slices_config(slices: list[tuple[Path, int, int]], dtype: str) -> dict[str, Any]:
    return {
        "merge_method": "passthrough",
        "slices": [{"sources": [{"model": str(m), "layer_range": [a, b]}]} for m, a, b in slices],
        "dtype": dtype,
        "out_dtype": dtype,
    }


@pytest.mark.parametrize("family_name", ["llama", "gpt2"])
def test_passthrough_equals_mergekit(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path
) -> None:
    """Deeper and from two models: every tensor's bits, and the output's layer count."""
    if family_name == "llama":
        fam: Family = request.getfixturevalue("llama")
        slices, dtype, key = (
            [(fam.task, 0, 4), (fam.language, 2, 6)],
            "bfloat16",
            "num_hidden_layers",
        )
    else:
        a, b = request.getfixturevalue("gpt2_pair")
        slices, dtype, key = [(a, 0, 3), (b, 1, 4), (a, 3, 4)], "float32", "n_layer"
    recipe = {
        "method": "passthrough",
        "models": list(dict.fromkeys(str(m) for m, _, _ in slices)),
        "params": {"slices": [{"sources": [{"model": str(m), "layer_range": [s, e]}]}
                              for m, s, e in slices]},
    }  # fmt: skip
    ours = run_merge(recipe).out_dir
    theirs = run_mergekit(_slices_config(slices, dtype), tmp_path / "mergekit")
    assert worst_ulps(ours, theirs) == 0
    layers = sum(e - s for _, s, e in slices)
    for out in (ours, theirs):
        assert json.loads((out / "config.json").read_text())[key] == layers


# -- the sparsifying methods ----------------------------------------------------------------------
# mergekit's generalized task arithmetic computes in the config's `dtype`: float32 is what the
# engine computes in, so both widen, compute and round once to `out_dtype`.
def _sparse_config(
    method: str, fam: Family, per_model: list[tuple[str, dict[str, Any]]], shared: dict[str, Any],
    out_dtype: str,
) -> dict[str, Any]:  # fmt: skip
    return {
        "merge_method": method,
        "base_model": str(fam.base),
        "models": [{"model": str(getattr(fam, m)), "parameters": p} for m, p in per_model],
        "parameters": shared,
        "dtype": "float32",
        "out_dtype": out_dtype,
    }


BREADCRUMBS_CASES = [
    ("breadcrumbs", [{"weight": 0.7, "density": 0.8, "gamma": 0.05},
                     {"weight": 0.4, "density": 0.8, "gamma": 0.05}], {}),
    ("breadcrumbs", [{"weight": 0.5, "density": 0.6, "gamma": 0.2},
                     {"weight": 1.0, "density": 0.9, "gamma": 0.01}],
     {"normalize": True, "lambda": 1.2}),
    ("breadcrumbs_ties", [{"weight": 1.0, "density": 0.5, "gamma": 0.1},
                          {"weight": 0.6, "density": 0.5, "gamma": 0.1}],
     {"normalize": True, "lambda": 0.8}),
    ("breadcrumbs_ties", [{"weight": [0.2, 1.0], "density": [0.4, 0.9], "gamma": 0.02},
                          {"weight": 0.6, "density": 0.7, "gamma": [0.0, 0.1]}], {}),
]  # fmt: skip


def _as_recipe_params(per_model: list[dict[str, Any]], shared: dict[str, Any]) -> dict[str, Any]:
    params = {key: [p[key] for p in per_model] for key in ("density", "gamma")}
    return {**params, "weights": [p["weight"] for p in per_model], **shared}


def _ambiguous(
    fam: Family, names: list[str], per_model: list[dict[str, Any]], name: str
) -> torch.Tensor:
    """Entries whose breadcrumbs mask depends on how mergekit's (unstable) sort orders equal
    |δ| at a cut, for any of the models."""
    base = load(fam.base)[name].float()
    layer = layer_of(name)
    found = torch.zeros_like(base, dtype=torch.bool)
    for model, p in zip(names, per_model, strict=True):
        delta = load(getattr(fam, model))[name].float() - base

        def value(v: Any) -> float:
            return gradient(v, layer, fam.num_layers) if isinstance(v, list) else float(v)

        found |= tie_ambiguous(delta, value(p["density"]), value(p["gamma"]))
    return found


@pytest.mark.parametrize("family_name", ["llama32", "llama"])
@pytest.mark.parametrize(
    ("method", "per_model", "shared"), BREADCRUMBS_CASES,
    ids=["plain", "normalize-lambda", "ties", "ties-gradients"],
)  # fmt: skip
def test_breadcrumbs_equals_mergekit(
    method: str, per_model: list[dict[str, Any]], shared: dict[str, Any], family_name: str,
    request: pytest.FixtureRequest, run_merge: Any, tmp_path: Path,
) -> None:  # fmt: skip
    """Equal bits, except where |δ| ties at a cut: mergekit's sort is not stable, so which of
    equal entries it keeps there is arbitrary (the engine takes them in flat order). bf16
    deltas tie often; float32 ones rarely."""
    fam: Family = request.getfixturevalue(family_name)
    names = ["task", "language"]
    recipe = {
        "method": method,
        "base": fam.base,
        "models": [getattr(fam, m) for m in names],
        "params": _as_recipe_params(per_model, shared),
    }
    ours = load(run_merge(recipe).out_dir)
    dtype = "bfloat16" if family_name == "llama" else "float32"
    config = _sparse_config(method, fam, list(zip(names, per_model, strict=True)), shared, dtype)
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    assert set(ours) == set(theirs)
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    ambiguous_total = identical = 0
    for name, tensor in ours.items():
        differ = tensor.view(bits) != theirs[name].view(bits)
        if not differ.any():
            identical += 1
            continue
        ambiguous = _ambiguous(fam, names, per_model, name)
        assert not (differ & ~ambiguous).any(), f"{name}: differs beyond tied |δ| at the cuts"
        ambiguous_total += int(ambiguous.sum())
    print(f"{identical}/{len(ours)} tensors equal bit for bit; {ambiguous_total} tied entries")
    if dtype == "float32":
        assert identical >= len(ours) - 4


TIES_VARYING = [
    {"weight": [0.0, 0.4, 1.0], "density": [1.0, 0.7, 0.1]},
    {"weight": [{"filter": "mlp", "value": -0.3}, {"value": 0.8}], "density": 0.5},
    {"weight": 0.6, "density": [{"filter": "self_attn", "value": 0.9}, {"value": 0.33}]},
]


LAMBDA_VARYING = [{"filter": "mlp", "value": [0.6, 1.3]}, {"value": 0.9}]


def test_ties_weights_and_densities_that_vary_equal_mergekit(
    llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """Weights (0 and negative among them) and densities per model, and λ, by layer and
    tensor: equal bits, but where |δ| ties at a cut (float32 deltas rarely do)."""
    names = ["task", "language", "task2"]
    params = {"weights": [p["weight"] for p in TIES_VARYING],
              "density": [p["density"] for p in TIES_VARYING],
              "lambda": LAMBDA_VARYING}  # fmt: skip
    recipe = {"method": "ties", "base": llama32.base,
              "models": [getattr(llama32, m) for m in names], "params": params}  # fmt: skip
    ours = load(run_merge(recipe).out_dir)
    models = list(zip(names, TIES_VARYING, strict=True))
    config = _sparse_config("ties", llama32, models, {"lambda": LAMBDA_VARYING}, "float32")
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    assert set(ours) == set(theirs)
    base, identical = load(llama32.base), 0
    for name, tensor in ours.items():
        differ = tensor.view(torch.int32) != theirs[name].view(torch.int32)
        identical += not differ.any()
        ambiguous = torch.zeros_like(differ)
        for model, p in models:
            delta = load(getattr(llama32, model))[name] - base[name]
            kept = setting_value(p["density"], name, llama32.num_layers)
            ambiguous |= tie_ambiguous(delta, kept, 0.0)
        assert not (differ & ~ambiguous).any(), f"{name}: differs beyond tied |δ| at the cuts"
    assert identical >= len(ours) - 4


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(
    ("chunk_elements", "lambda_"), [(1000, 0.9), (None, 0.9), (1000, LAMBDA_VARYING)]
)
def test_task_arithmetic_weights_that_vary_equal_mergekit(
    family_name: str, chunk_elements: int | None, lambda_: Any, request: pytest.FixtureRequest,
    run_merge: Any, tmp_path: Path,
) -> None:  # fmt: skip
    """Weights per model as a gradient, as filters (negative among them) and as a number, and λ,
    each resolved per tensor: the config as Layerswap translates it (mergekit's arithmetic in
    the config's dtype) equals mergekit-yaml's output bit for bit, whole tensors or in
    pieces."""
    fam: Family = request.getfixturevalue(family_name)
    dtype = "bfloat16" if family_name == "llama" else "float32"
    weights = [[0.0, 0.4, 1.0], [{"filter": "mlp", "value": -0.3}, {"value": 0.8}], 0.6]
    names = ["task", "language", "task2"]
    config = family_config(
        "task_arithmetic", fam, [(m, {"weight": w}) for m, w in zip(names, weights, strict=True)],
        dtype, dtype=dtype, base_model=str(fam.base), parameters={"lambda": lambda_},
    )  # fmt: skip
    options = {"chunk_elements": chunk_elements} if chunk_elements else {}
    ours = translated_merge(config, run_merge, **options)
    assert worst_ulps(ours, run_mergekit(config, tmp_path / "mergekit")) == 0
    # the weights did vary: the mlp of layer 0 and of the last layer merge differently
    base, merged = load(fam.base), load(ours)
    first, last = (f"model.layers.{i}.mlp.up_proj.weight" for i in (0, fam.num_layers - 1))
    moved = [(merged[n].float() - base[n].float()).abs().mean() for n in (first, last)]
    assert moved[0] != moved[1]


def test_breadcrumbs_rescale_within_rounding_of_mergekit(
    llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """With rescale, mergekit's float32 norm sums round differently from the engine's exact
    ones: the results differ by float32 rounding of the scale (and tied |δ| at the cuts)."""
    names = ["task", "language"]
    per_model = [{"weight": 0.5, "density": 0.9, "gamma": 0.01},
                 {"weight": 0.5, "density": 0.6, "gamma": 0.2}]  # fmt: skip
    shared = {"normalize": True, "rescale": True}
    recipe = {
        "method": "breadcrumbs",
        "base": llama32.base,
        "models": [llama32.task, llama32.language],
        "params": _as_recipe_params(per_model, shared),
    }
    ours = load(run_merge(recipe).out_dir)
    config = _sparse_config(
        "breadcrumbs", llama32, list(zip(names, per_model, strict=True)), shared, "float32"
    )
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    base, inputs = load(llama32.base), [load(getattr(llama32, m)) for m in names]
    eps = torch.finfo(torch.float32).eps
    for name, tensor in ours.items():
        ambiguous = _ambiguous(llama32, names, per_model, name)
        # each scale ≤ 1/density_i = 5/3: a few float32 roundings of Σ 0.5·scale·|δ|
        magnitude = base[name].abs() + sum(0.5 * (5 / 3) * (m[name] - base[name]).abs()
                                           for m in inputs)  # fmt: skip
        assert_within_ulps(
            tensor[~ambiguous], theirs[name][~ambiguous], 1, name, 8 * eps * magnitude[~ambiguous]
        )


def _dropped_fraction(out: dict[str, torch.Tensor], base: dict[str, torch.Tensor]) -> float:
    kept = total = 0
    for name, b in base.items():
        if b.dim() == 2:
            kept, total = kept + int((out[name] != b).sum()), total + b.numel()
    return kept / total


def _kept_by_rank(
    out: dict[str, torch.Tensor], base: dict[str, torch.Tensor], model: dict[str, torch.Tensor]
) -> tuple[float, float]:
    """The shares kept of each row's smallest and largest third of |δ|."""
    low = high = count = 0
    for name, b in base.items():
        if b.dim() != 2:
            continue
        ranks = (model[name] - b).abs().argsort(dim=1).argsort(dim=1)
        kept, third = out[name] != b, b.shape[1] // 3
        low += int(kept[ranks < third].sum())
        high += int(kept[ranks >= b.shape[1] - third].sum())
        count += int((ranks < third).sum())
    return low / count, high / count


@pytest.mark.parametrize(
    ("method", "parameters"),
    [("dare_linear", {"density": 0.3}), ("della_linear", {"density": 0.3, "epsilon": 0.2})],
)
def test_random_drops_agree_with_mergekit_in_distribution(
    method: str, parameters: dict[str, Any], llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """One model, weight 1: both tools keep about `density` of the delta, scaled by ‖δ‖₁ over
    the kept entries' (DARE: ≈ 1/density), and tensor by tensor their scales agree within
    noise."""
    recipe = {"method": method, "base": llama32.base, "models": [llama32.task],
              "params": {**parameters, "weights": [1.0]}}  # fmt: skip
    ours = load(run_merge(recipe).out_dir)
    config = _sparse_config(
        method, llama32, [("task", {"weight": 1.0, **parameters})], {}, "float32"
    )
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    base, task = load(llama32.base), load(llama32.task)
    for out in (ours, theirs):
        assert abs(_dropped_fraction(out, base) - 0.3) < 0.01
        if method == "della_linear":  # p = 0.1 … 0.5 by rank in the row
            low, high = _kept_by_rank(out, base, task)
            assert abs(low - (0.3 - 0.4 / 3)) < 0.02 and abs(high - (0.3 + 0.4 / 3)) < 0.02
    ratios = []
    for name, b in base.items():
        if b.dim() != 2:
            continue
        delta = (task[name] - b).double()
        scales = []
        for out in (ours, theirs):
            kept = out[name] != b
            scale = delta.abs().sum() / delta[kept].abs().sum()
            moved = (out[name].double() - b.double())[kept] / delta[kept]
            assert float((moved - scale).abs().median()) < 1e-4 * float(scale), name
            scales.append(float(scale))
        ratios.append(scales[0] / scales[1])
        if method == "dare_linear":  # DELLA keeps larger entries more often: a smaller scale
            # ‖kept‖₁/‖δ‖₁ of n entries kept with p = 0.3: sd ≈ 1.25·√(0.7 / (0.3·n))
            sd = 1.25 * math.sqrt(0.7 / (0.3 * b.numel()))
            assert all(abs(0.3 * x - 1) < 6 * sd for x in scales), (name, scales)
    assert abs(statistics.fmean(ratios) - 1) < 0.03, ratios  # ~4 sd


@pytest.mark.parametrize(
    ("method", "parameters"),
    [("dare_ties", {"density": 0.4}), ("della", {"density": 0.4, "epsilon": 0.1})],
)
def test_random_drops_with_consensus_agree_with_mergekit(
    method: str, parameters: dict[str, Any], llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """Two models, sign consensus: the share of entries the merge changes agrees (it is
    1 − (1 − density)² ≈ 0.64 before the consensus drops some), and so does the size of the
    change."""
    names = ["task", "language"]
    recipe = {"method": method, "base": llama32.base,
              "models": [getattr(llama32, m) for m in names],
              "params": {**parameters, "weights": [1.0, 0.7]}}  # fmt: skip
    ours = load(run_merge(recipe).out_dir)
    per_model = [
        ("task", {"weight": 1.0, **parameters}),
        ("language", {"weight": 0.7, **parameters}),
    ]
    theirs = load(run_mergekit(_sparse_config(method, llama32, per_model, {}, "float32"),
                               tmp_path / "mergekit"))  # fmt: skip
    base = load(llama32.base)
    changed = [_dropped_fraction(out, base) for out in (ours, theirs)]
    assert abs(changed[0] - changed[1]) < 0.01 and 0.5 < changed[0] < 0.7, changed
    sizes = [
        sum(float((out[n].double() - b.double()).abs().sum()) for n, b in base.items())
        for out in (ours, theirs)
    ]
    assert abs(sizes[0] / sizes[1] - 1) < 0.03, sizes
