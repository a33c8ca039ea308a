"""multislerp, karcher, nearswap, sce and arcee_fusion against plain-torch references written
here from their formulas (float64, whole tensors), with tensors read whole and in pieces; the
recipe and mergekit-config errors that name their field.

Nothing here uses the engine's kernels: each reference computes its method from the formula in
the method's docstring (and docs/concepts/methods.md) on tensors loaded with safetensors.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import RecipeError
from engine.kernels.sce_torch import _variance
from engine.mergekit import translate
from engine.plan.model import TensorPlan, Term
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.reference import layer_of, load

SMALL_CHUNK = 1000  # every 2-D weight of the test models is larger: read in pieces
CHUNKS = [None, SMALL_CHUNK]
CHUNK_IDS = ["whole", "pieces"]
EPS32 = torch.finfo(torch.float32).eps


def _run(run_merge: Any, recipe: dict[str, Any], chunk: int | None) -> dict[str, torch.Tensor]:
    result = run_merge(recipe, **({"chunk_elements": chunk} if chunk else {}))
    return load(result.out_dir)


def _close(actual: torch.Tensor, expected: torch.Tensor, name: str, relative: float) -> None:
    """|actual − expected| within `relative` of the tensor's largest |expected| (float32
    rounding of whole-tensor sums shows at that scale, not per element)."""
    scale = float(expected.abs().max())
    error = float((actual.double() - expected).abs().max())
    assert error <= relative * scale, f"{name}: {error} > {relative} * {scale}"


# -- multislerp -------------------------------------------------------------------------------
def multislerp(
    vs: list[torch.Tensor], weights: list[float], *, normalize: bool, eps: float
) -> torch.Tensor:
    """The barycentre on the sphere, as the method's docstring says, in float64."""
    flat = [v.double().flatten() for v in vs]
    w = torch.tensor(weights, dtype=torch.float64)
    if normalize:
        w = w / w.sum()
    norms = [float(v.norm()) for v in flat]
    units = [v / (n + eps) for v, n in zip(flat, norms, strict=True)]
    mean = sum(wi * u for wi, u in zip(w, units, strict=True))
    mean = mean / mean.norm()
    tangent = sum(wi * (u - (u @ mean) * mean) for wi, u in zip(w, units, strict=True))
    length = float(tangent.norm()) + eps
    out = math.cos(length) * mean + math.sin(length) / length * tangent
    return (out * float(w @ torch.tensor(norms, dtype=torch.float64))).view(vs[0].shape)


@pytest.mark.parametrize("chunk", CHUNKS, ids=CHUNK_IDS)
@pytest.mark.parametrize(
    ("with_base", "params"),
    [(False, {}), (True, {"weights": [1.0, [0.5, 2.0], 0.8]}),
     (True, {"weights": [0.4, 0.5, 0.3], "normalize_weights": False, "eps": 1e-4})],
    ids=["uniform", "base-gradient", "unnormalized"],
)  # fmt: skip
def test_multislerp_matches_formula(
    llama32: Family, run_merge: Any, with_base: bool, params: dict[str, Any], chunk: int | None
) -> None:
    paths = [llama32.task, llama32.language, llama32.task2]
    recipe: dict[str, Any] = {"method": "multislerp", "models": paths, "params": params}
    if with_base:
        recipe["base"] = llama32.base
    out = _run(run_merge, recipe, chunk)
    models, base = [load(p) for p in paths], load(llama32.base)
    for name, tensor in out.items():
        layer = layer_of(name)
        at = layer / 5 if layer is not None else 0.0
        weights = [w if isinstance(w, float) else w[0] + at * (w[1] - w[0])
                   for w in params.get("weights", [1.0] * 3)]  # fmt: skip
        vs = [m[name].double() - (base[name].double() if with_base else 0) for m in models]
        expected = multislerp(vs, weights, normalize=params.get("normalize_weights", True),
                              eps=params.get("eps", 1e-8))  # fmt: skip
        if with_base:
            expected = expected + base[name].double()
        _close(tensor, expected, name, 16 * EPS32)


def test_multislerp_of_unchanged_tensors_keeps_the_base(llama: Family, run_merge: Any) -> None:
    """The bf16 family's norm weights are the base's in every model: three task vectors of
    zero have no direction; mergekit refuses them, Layerswap keeps the base."""
    out = _run(run_merge, {"method": "multislerp", "base": llama.base,
                           "models": [llama.task, llama.language, llama.task2]}, None)  # fmt: skip
    base = load(llama.base)
    models = [load(m) for m in (llama.task, llama.language, llama.task2)]
    unchanged = [n for n in base if all(torch.equal(m[n], base[n]) for m in models)]
    assert unchanged and all(torch.equal(out[n], base[n]) for n in unchanged)


def _plan(op: str, shape: tuple[int, ...], terms: int, **scalars: float) -> TensorPlan:
    made = tuple(Term(i, 1.0) for i in range(terms))
    return TensorPlan("w", shape, "F32", op, made, None, op, scalars=tuple(scalars.items()))  # type: ignore[arg-type]


def test_multislerp_refuses_directions_that_cancel() -> None:
    """Three models whose weighted directions sum to zero have no mean direction: refused,
    naming the weights, as mergekit refuses them; two are interpolated linearly."""
    from engine.kernels.sphere_torch import MultiSlerp

    x = torch.linspace(-1, 1, 64)
    inputs = [x, -x, torch.zeros(64)]

    def read(source: int, start: int, count: int) -> torch.Tensor:
        return inputs[source][start : start + count].clone()

    cancel = MultiSlerp(read, _plan("multislerp", (64,), 3, base=0.0, normalize_weights=1.0,
                                    eps=1e-8), chunk=1 << 20)  # fmt: skip
    with pytest.raises(RecipeError) as error:
        cancel.chunk(0, 64)
    assert error.value.details["field"] == "params.weights"
    pair = MultiSlerp(read, _plan("multislerp", (64,), 2, base=0.0, normalize_weights=1.0,
                                  eps=1e-8), chunk=16)  # in pieces  # fmt: skip
    assert torch.equal(pair.chunk(0, 64), torch.zeros(64))  # 0.5·x + 0.5·(−x)


# -- karcher ----------------------------------------------------------------------------------
def karcher(xs: list[torch.Tensor], *, max_iter: int, tol: float) -> torch.Tensor:
    """The Karcher mean of the directions by gradient descent, as the docstring says, float64."""
    flat = [x.double().flatten() for x in xs]
    norms = [float(x.norm()) for x in flat]
    points = [x / n for x, n in zip(flat, norms, strict=True) if n > tol]
    weight = 1.0 / len(points)
    mean = sum(weight * p for p in points)
    mean = mean / mean.norm()
    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for p in points:
            cos = float(torch.clamp(mean @ p, -1.0, 1.0))
            theta = math.acos(cos)
            if theta >= tol:
                step += weight * theta / math.sin(theta) * (p - cos * mean)
        length = float(step.norm())
        if length < tol:
            break
        mean = math.cos(length) * mean + math.sin(length) * step / length
        mean = mean / mean.norm()
    return (sum(norms) / len(xs) * mean).view(xs[0].shape)


def _nearly_parallel(xs: list[torch.Tensor]) -> bool:
    """Whether some two of the tensors are within about 2.5° of each other."""
    flat = [x.double().flatten() / x.double().norm() for x in xs]
    return any(float(a @ b) > 0.999 for i, a in enumerate(flat) for b in flat[i + 1 :])


@pytest.mark.parametrize("chunk", CHUNKS, ids=CHUNK_IDS)
@pytest.mark.parametrize("params", [{}, {"max_iter": 50, "tol": 1e-9}], ids=["default", "long"])
def test_karcher_matches_formula(
    llama32: Family, run_merge: Any, params: dict[str, Any], chunk: int | None
) -> None:
    """Within 1e-6 of the float64 mean; directions within a few degrees of each other (the
    norm weights, all near 1) only within 1e-3: a tensor read whole takes mergekit's float32
    steps, whose arccos of a cosine near 1 resolves the angle to about √(2ε) ≈ 5e-4."""
    paths = [llama32.task, llama32.language, llama32.task2]
    out = _run(run_merge, {"method": "karcher", "models": paths, "params": params}, chunk)
    models = [load(p) for p in paths]
    max_iter, tol = params.get("max_iter", 10), params.get("tol", 1e-5)
    for name, tensor in out.items():
        xs = [m[name] for m in models]
        expected = karcher(xs, max_iter=max_iter, tol=tol)
        _close(tensor, expected, name, 1e-3 if _nearly_parallel(xs) else 1e-6)
    # the mean of three directions lies between them: closer to each than they are apart
    name = "model.layers.2.mlp.down_proj.weight"
    a, b = models[0][name].double(), models[1][name].double()
    assert (out[name].double() - a).norm() < (b - a).norm()
    assert not _nearly_parallel([m[name] for m in models])


# -- nearswap ---------------------------------------------------------------------------------
def nearswap(base: torch.Tensor, model: torch.Tensor, t: float) -> torch.Tensor:
    a, b = base.double(), model.double()
    weight = torch.clamp(t / torch.clamp((a - b).abs(), min=1e-6), 0.0, 1.0)
    return weight * b + (1 - weight) * a


@pytest.mark.parametrize("t", [0.002, [0.0005, 0.004], [{"filter": "mlp", "value": 0.01},
                                                         {"value": 0.0}]],
                         ids=["number", "gradient", "filters"])  # fmt: skip
def test_nearswap_matches_formula(llama32: Family, run_merge: Any, t: Any) -> None:
    out = _run(run_merge, {"method": "nearswap", "base": llama32.base, "models": [llama32.task],
                           "params": {"t": t}}, None)  # fmt: skip
    base, model = load(llama32.base), load(llama32.task)
    for name, tensor in out.items():
        layer = layer_of(name)
        at = layer / 5 if layer is not None else 0.0
        value = (t if isinstance(t, float) else t[0] + at * (t[1] - t[0]) if
                 isinstance(t[0], float) else 0.01 if "mlp" in name else 0.0)  # fmt: skip
        expected = nearswap(base[name], model[name], value)
        slack = 4 * EPS32 * (base[name].abs() + model[name].abs())
        assert bool(((tensor.double() - expected).abs() <= slack).all()), name
    name = "model.layers.0.self_attn.q_proj.weight"
    if not isinstance(t, float) and not isinstance(t[0], float):  # t = 0 there: the base
        assert torch.equal(out[name], base[name])


# -- sce --------------------------------------------------------------------------------------
def sce(base: torch.Tensor, models: list[torch.Tensor], select: float) -> torch.Tensor:
    """Select, calculate, erase, as the docstring says, float64 (equal weights where the mean
    squares sum below 1e-6); of equal variances at the cut the first in flat order."""
    b = base.double().flatten()
    deltas = torch.stack([m.double().flatten() - b for m in models])
    if select < 1:
        variance = deltas.var(dim=0, unbiased=False)
        k = int(int((variance != 0).sum()) * select)
        order = sorted(range(len(variance)), key=lambda i: -float(variance[i]))
        keep = torch.zeros_like(variance)
        keep[order[:k]] = 1.0
        deltas = deltas * keep
    energy = deltas.square().mean(dim=1)
    total = float(energy.sum())
    weights = energy / total if total >= 1e-6 else torch.full_like(energy, 1 / len(models))
    elected = torch.where(deltas.sum(dim=0) >= 0, 1.0, -1.0)
    agree = (torch.sign(deltas) == elected).double() * weights[:, None]
    merged = (deltas * agree).sum(dim=0) / agree.sum(dim=0).clamp(min=1e-6)
    return (b + merged).view(base.shape)


@pytest.mark.parametrize("chunk", CHUNKS, ids=CHUNK_IDS)
@pytest.mark.parametrize("select", [1.0, 0.3], ids=["all", "top-30"])
def test_sce_matches_formula(
    llama32: Family, run_merge: Any, select: float, chunk: int | None
) -> None:
    """float32 deltas: no two variances tie at the cut, so either tie rule selects alike."""
    paths = [llama32.task, llama32.language, llama32.task2]
    out = _run(run_merge, {"method": "sce", "base": llama32.base, "models": paths,
                           "params": {"select_topk": select}}, chunk)  # fmt: skip
    base, models = load(llama32.base), [load(p) for p in paths]
    for name, tensor in out.items():
        expected = sce(base[name], [m[name] for m in models], select)
        change = float((expected - base[name].double()).abs().max())
        slack = 4 * EPS32 * base[name].abs().double() + 1e-5 * change
        assert bool(((tensor.double() - expected).abs() <= slack).all()), name


# -- arcee_fusion -----------------------------------------------------------------------------
def importance(base: torch.Tensor, model: torch.Tensor) -> torch.Tensor:
    a, b = base.double(), model.double()
    rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    p = torch.softmax(rows_b, dim=-1) + 1e-8
    q = torch.softmax(rows_a, dim=-1) + 1e-8
    kl = (p * (p / q).log()).sum(dim=-1, keepdim=True)
    return ((rows_b - rows_a).abs() * kl).flatten()


def fusion_threshold(values: torch.Tensor) -> float:
    ordered = values.sort().values
    n = len(ordered)
    q1, median, q3 = (float(ordered[int(q * (n - 1))]) for q in (0.25, 0.5, 0.75))
    return median + 1.5 * (q3 - q1)


@pytest.mark.parametrize("chunk", CHUNKS, ids=CHUNK_IDS)
def test_arcee_fusion_matches_formula(
    gpt2_pair: tuple[Path, Path], run_merge: Any, chunk: int | None
) -> None:
    """Each entry is the base's, or base + (model − base) (the model's, to rounding) where its
    importance reaches the threshold; float32 may decide otherwise within 1% of it (it
    measures these KLs to 5e-4 to 4e-3: two unrelated models, whose rows' softmaxes differ;
    rows nearly alike have a KL that float32, mergekit's precision and the kernel's, resolves
    to rounding noise only)."""
    base_path, model_path = gpt2_pair
    out = _run(run_merge, {"method": "arcee_fusion", "base": base_path, "models": [model_path]},
               chunk)  # fmt: skip
    base, model = load(base_path), load(model_path)
    taken = 0
    for name, tensor in out.items():
        score = importance(base[name], model[name])
        threshold = fusion_threshold(score)
        a, b, got = base[name].flatten(), model[name].flatten(), tensor.flatten()
        near = (score - threshold).abs() <= 1e-2 * abs(threshold)
        takes = (score >= threshold) & ~near
        rounding = EPS32 * (a.abs() + b.abs())
        assert bool(((got - b).abs() <= rounding)[takes].all()), name
        assert torch.equal(got[~takes & ~near], a[~takes & ~near]), name
        taken += int((takes & (a != b)).sum())
    assert taken > 0  # some entries took the model's value


# -- errors -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"method": "multislerp", "models": ["a"]}, "models"),
        ({"method": "multislerp", "models": ["a", "b"], "params": {"weights": [1.0]}},
         "params.weights"),
        ({"method": "multislerp", "base": "a", "models": ["a", "b"]}, "models.0"),
        ({"method": "multislerp", "models": ["a", "b"], "params": {"eps": -1}}, "params.eps"),
        ({"method": "multislerp", "models": ["a", "b"], "params": {"normalize_weights": 2}},
         "params.normalize_weights"),
        ({"method": "karcher", "models": ["a"]}, "models"),
        ({"method": "karcher", "models": ["a", "b"], "params": {"max_iter": -1}},
         "params.max_iter"),
        ({"method": "karcher", "models": ["a", "b"], "params": {"tol": "small"}}, "params.tol"),
        ({"method": "karcher", "models": ["a", "b"], "params": {"weights": [1, 2]}},
         "params.weights"),
        ({"method": "nearswap", "base": "b", "models": ["a"]}, "params"),
        ({"method": "nearswap", "base": "b", "models": ["a"], "params": {}}, "params.t"),
        ({"method": "nearswap", "base": "b", "models": ["a", "c"], "params": {"t": 0.1}},
         "models"),
        ({"method": "nearswap", "models": ["a"], "params": {"t": 0.1}}, "base"),
        ({"method": "sce", "base": "b", "models": ["a"], "params": {"select_topk": 1.5}},
         "params.select_topk"),
        ({"method": "sce", "base": "b", "models": ["a"], "params": {"select_topk": [0.5, -1]}},
         "params.select_topk"),
        ({"method": "sce", "models": ["a", "c"]}, "base"),
        ({"method": "arcee_fusion", "base": "b", "models": ["a", "c"]}, "models"),
        ({"method": "arcee_fusion", "base": "b", "models": ["a"], "params": {"t": 1}},
         "params.t"),
    ],
    ids=["multislerp-one", "multislerp-weights", "multislerp-base-in-models", "multislerp-eps",
         "multislerp-switch", "karcher-one", "karcher-max-iter", "karcher-tol",
         "karcher-unknown", "nearswap-no-params", "nearswap-no-t", "nearswap-two",
         "nearswap-no-base", "sce-above-one", "sce-gradient-below-zero", "sce-no-base",
         "fusion-two", "fusion-unknown"],
)  # fmt: skip
def test_invalid_recipes_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe(recipe)
    assert error.value.details["field"] == field, error.value


@pytest.mark.parametrize(
    ("recipe", "field", "problem"),
    [
        ({"method": "nearswap", "params": {"t": [{"filter": "mlp", "value": 0.1}]}},
         "params.t", "no filter matches"),
        ({"method": "sce", "params": {"select_topk": [{"filter": "mlp", "value": 0.5}]}},
         "params.select_topk", "no filter matches"),
        ({"method": "multislerp", "params": {"weights": [1.0, -1.0]}},
         "params.weights", "sum to 0"),
    ],
    ids=["nearswap-filter", "sce-filter", "multislerp-zero-sum"],
)  # fmt: skip
def test_plan_time_errors_name_their_field(
    llama: Family, run_merge: Any, recipe: dict[str, Any], field: str, problem: str
) -> None:
    data = {**recipe, "base": llama.base, "models": [llama.task]}
    if recipe["method"] == "multislerp":
        data["models"] = [llama.task, llama.language]
    with pytest.raises(RecipeError) as error:
        run_merge(data)
    assert error.value.details["field"] == field
    assert problem in error.value.message


def _translated(config: dict[str, Any]) -> Any:
    return translate(config, is_local=lambda source: True)


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"merge_method": "multislerp", "models": [{"model": "a"}, {"model": "b"}]},
         "models.0.parameters.weight"),
        ({"merge_method": "multislerp",
          "models": [{"model": "a", "parameters": {"weight": 1}}]}, "models"),
        ({"merge_method": "karcher", "models": [{"model": "a"}, {"model": "b"}],
          "parameters": {"max_iter": [1, 5]}}, "parameters.max_iter"),
        ({"merge_method": "karcher", "models": [{"model": "a"}, {"model": "b"}],
          "parameters": {"max_iter": 2.5}}, "parameters.max_iter"),
        ({"merge_method": "nearswap", "base_model": "b", "models": [{"model": "a"}]},
         "parameters.t"),
        ({"merge_method": "nearswap", "base_model": "b", "parameters": {"t": 0.1},
          "models": [{"model": "a"}, {"model": "c"}]}, "models"),
        ({"merge_method": "sce", "models": [{"model": "a"}]}, "base_model"),
        ({"merge_method": "arcee_fusion", "models": [{"model": "a"}, {"model": "c"}]},
         "base_model"),
    ],
    ids=["multislerp-no-weight", "multislerp-one", "karcher-gradient", "karcher-fraction",
         "nearswap-no-t", "nearswap-two", "sce-no-base", "fusion-no-base"],
)  # fmt: skip
def test_invalid_mergekit_configs_name_their_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        _translated(config)
    assert error.value.details["field"] == field, error.value


def test_mergekit_configs_translate() -> None:
    """Each config as mergekit reads it: karcher merges its base_model as one more model last;
    sce's select_topk beyond [0, 1] means all or none; arcee_fusion and nearswap take the base
    from base_model (listed among the models too)."""
    karcher_config = {"merge_method": "karcher", "base_model": "z",
                      "models": [{"model": "a"}, {"model": "b"}],
                      "parameters": {"max_iter": 9999, "tol": "1e-9"}}  # fmt: skip
    recipe = _translated(karcher_config).recipe
    assert recipe.models == ["a", "b", "z"] and recipe.base is None
    assert (recipe.params.max_iter, recipe.params.tol) == (9999, 1e-9)
    sce_config = {"merge_method": "sce", "base_model": "b", "models": [{"model": "a"}],
                  "parameters": {"select_topk": 3, "int8_mask": True}}  # fmt: skip
    assert _translated(sce_config).recipe.params.select_topk == 1.0
    fusion = {"merge_method": "arcee_fusion", "base_model": "b",
              "models": [{"model": "b"}, {"model": "a"}]}  # fmt: skip
    recipe = _translated(fusion).recipe
    assert (recipe.base, recipe.models) == ("b", ["a"])
    slerp_many = {"merge_method": "multislerp", "base_model": "b",
                  "models": [{"model": "a", "parameters": {"weight": [0, 1]}},
                             {"model": "c", "parameters": {"weight": 2}}],
                  "parameters": {"normalize_weights": False, "eps": 1e-6}}  # fmt: skip
    recipe = _translated(slerp_many).recipe
    assert recipe.params.weights == [[0.0, 1.0], 2.0] and recipe.base == "b"
    assert (recipe.params.normalize_weights, recipe.params.eps) == (False, 1e-6)


def test_plans_record_each_tensors_scalars(llama: Family) -> None:
    """A gradient t resolves per layer into the plan (its digest covers it)."""
    from engine.planner import make_plan
    from tests.helpers import stringify

    recipe = {"method": "nearswap", "base": llama.base, "models": [llama.task],
              "params": {"t": [0.0, 1.0]}}  # fmt: skip
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    plan.close()
    by_layer = {
        t.layer: dict(t.scalars)["t"] for t in plan.tensors if t.name.endswith("q_proj.weight")
    }
    assert by_layer == {i: i / 5 for i in range(6)}
    assert plan.to_dict()["tensors"][0]["scalars"] == {"t": 0.0}


def test_arcee_fusion_samples_a_large_tensor_the_same_each_time() -> None:
    """Of a tensor of more than a million entries the quantiles come from a fixed sample of a
    million (mergekit draws one at random each run): the same output each time, its threshold
    within 1% of the whole tensor's."""
    from engine.kernels.fusion_torch import SAMPLE, Fusion

    generator = torch.Generator().manual_seed(5)
    shape = (1200, 1000)
    assert shape[0] * shape[1] > SAMPLE
    base = torch.randn(shape, generator=generator) * 0.02
    model = base + torch.randn(shape, generator=generator) * 0.01
    inputs = [base.flatten(), model.flatten()]

    def read(source: int, start: int, count: int) -> torch.Tensor:
        return inputs[source][start : start + count].clone()

    def merged() -> torch.Tensor:
        fusion = Fusion(read, _plan("arcee_fusion", shape, 2), chunk=1 << 18)
        return torch.cat([fusion.chunk(s, min(1 << 16, base.numel() - s))
                          for s in range(0, base.numel(), 1 << 16)])  # fmt: skip

    first, second = merged(), merged()
    assert torch.equal(first, second)
    score = importance(base, model)
    exact = fusion_threshold(score)
    taken = first != base.flatten()
    sampled = float(score[taken].min())  # the smallest importance taken bounds the threshold
    assert abs(sampled - exact) <= 0.01 * exact
    assert 0 < int(taken.sum()) < base.numel() // 4


@pytest.mark.parametrize("models", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_sce_variance_equals_torch_var_bit_for_bit(models: int, dtype: torch.dtype) -> None:
    """sce's elementwise variance over the models is torch.var's (mergekit's) to the bit: deltas
    of scales far apart, entries equal across the models, and zeros."""
    generator = torch.Generator().manual_seed(models)
    scales = 10 ** torch.randn(models, 1, generator=generator)
    deltas = (torch.randn(models, 300_007, generator=generator) * scales).to(dtype)  # 2 blocks
    deltas[:, :1000] = deltas[0, :1000].clone()
    deltas[0, 1000:1100] = 0
    expected = torch.var(deltas, dim=0, unbiased=False).abs()
    assert torch.equal(_variance(deltas), expected)
