"""nuslerp and model_stock against plain-torch references written from their formulas
(tests/reference.py, float64), with whole vectors and with vectors longer than a chunk; the
CPU kernels against the torch ones; a forward pass of outputs; per-tensor switches; and the
recipe errors that name their field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.errors import RecipeError
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.conftest import Family
from tests.engine.test_output import assert_forward_pass
from tests.helpers import stringify
from tests.reference import (
    assert_within_ulps,
    layer_of,
    load,
    model_stock,
    nuslerp,
)

EPS = torch.finfo(torch.float32).eps
SMALL_CHUNK = 1000  # every 2-D weight of the test models is longer: read by its moments


def _slack(*terms: torch.Tensor) -> torch.Tensor:
    """float32 rounding of the steps, 8·eps·Σ|terms| (measured worst: 2.2): it only shows
    where the output is far smaller than the tensors it is made of."""
    return 8 * EPS * sum(t.float().abs() for t in terms)  # type: ignore[return-value]


def _nuslerp_weight(name: str) -> float:
    """models[1]'s weight of the gradient [0.2, 1.0] below; models[0]'s is 0.3."""
    layer = layer_of(name)
    return 0.2 + 0.8 * (layer / 5 if layer is not None else 0.0)


@pytest.mark.parametrize("chunk", [None, SMALL_CHUNK], ids=["whole", "moments"])
@pytest.mark.parametrize(
    ("with_base", "params", "along"),
    [
        (False, {}, "tensor"),
        (True, {}, "tensor"),
        (False, {"nuslerp_flatten": False}, "rows"),
        (True, {"nuslerp_flatten": False, "nuslerp_row_wise": True}, "columns"),
    ],
    ids=["tensor", "tensor-base", "rows", "columns-base"],
)
def test_nuslerp_matches_formula(
    llama32: Family,
    run_merge: Any,
    with_base: bool,
    params: dict[str, Any],
    along: str,
    chunk: int | None,
) -> None:
    recipe: dict[str, Any] = {
        "method": "nuslerp",
        "models": [llama32.task, llama32.language],
        "params": {"weights": [0.3, [0.2, 1.0]], **params},
    }
    if with_base:
        recipe["base"] = llama32.base
    result = run_merge(recipe, **({"chunk_elements": chunk} if chunk else {}))
    a, b, base = load(llama32.task), load(llama32.language), load(llama32.base)
    out = load(result.out_dir)
    assert set(out) == set(a)
    for name, tensor in out.items():
        w = _nuslerp_weight(name)
        expected = nuslerp(w / (0.3 + w), a[name], b[name], base[name] if with_base else None,
                           along)  # fmt: skip
        slack = _slack(a[name], b[name], *([base[name]] * 2 if with_base else []))
        assert_within_ulps(tensor, expected.float(), name=name, slack=slack)


@pytest.mark.parametrize("chunk", [None, SMALL_CHUNK], ids=["whole", "moments"])
@pytest.mark.parametrize("filter_wise", [False, True], ids=["tensor", "rows"])
@pytest.mark.parametrize("count", [2, 3])
def test_model_stock_matches_formula(
    llama: Family, run_merge: Any, count: int, filter_wise: bool, chunk: int | None
) -> None:
    paths = [llama.task, llama.language, llama.task2][:count]
    recipe = {
        "method": "model_stock",
        "base": llama.base,
        "models": paths,
        "params": {"filter_wise": filter_wise},
    }
    result = run_merge(recipe, **({"chunk_elements": chunk} if chunk else {}))
    base, models = load(llama.base), [load(p) for p in paths]
    out = load(result.out_dir)
    assert set(out) == set(base)
    for name, tensor in out.items():
        inputs = [m[name] for m in models]
        expected = model_stock(base[name], inputs, "rows" if filter_wise else "tensor")
        slack = _slack(base[name], *(x / count for x in inputs))
        assert_within_ulps(tensor, expected.float(), name=name, slack=slack)
    # the task vectors agree a little: the output lies between the base and the average
    name = "model.layers.2.mlp.down_proj.weight"
    average = sum(m[name].float() for m in models) / count
    to_base = (out[name].float() - base[name].float()).norm()
    assert 0 < to_base < (average - base[name].float()).norm()


def _kernel_outputs(plan: Any, kernels: Any) -> dict[str, bytes]:
    return {t.name: b"".join(bytes(c) for c in kernels.output_bytes(t)) for t in plan.tensors}


@pytest.mark.parametrize("chunk", [2 * 1024 * 1024, SMALL_CHUNK], ids=["whole", "moments"])
@pytest.mark.parametrize(
    "recipe",
    [
        {"method": "nuslerp", "params": {"weights": [1.0, 3.0]}},
        {"method": "nuslerp", "params": {"nuslerp_flatten": False}, "base": True},
        {"method": "model_stock", "params": {"filter_wise": False}, "base": True},
        {"method": "model_stock", "params": {"filter_wise": True}, "base": True},
    ],
    ids=["nuslerp", "nuslerp-rows-base", "model_stock", "model_stock-rows"],
)
def test_cpu_kernels_equal_the_torch_kernels(
    llama: Family, recipe: dict[str, Any], chunk: int
) -> None:
    """The numba CPU path (angle_kernels) computes what the torch kernels (CUDA, float64) do:
    the same bytes where vectors are read whole; where they are measured by their moments, the
    moments are summed in float64 on one side and float32 per chunk on the other: within 1 ulp."""
    from engine.kernels.angle import AngleKernels, handles
    from engine.kernels.torch_kernels import Kernels

    data = {**recipe, "models": [llama.task, llama.language]}
    data["base"] = llama.base if recipe.get("base") else None
    plan = make_plan(parse_recipe(stringify(data)), resolve=Path, chunk_elements=chunk)
    try:
        assert handles(plan, "cpu")
        ours = _kernel_outputs(plan, AngleKernels(plan, chunk_elements=chunk))
        theirs = _kernel_outputs(plan, Kernels(plan, device="cpu", chunk_elements=chunk))
    finally:
        plan.close()
    long_vectors = 0
    for tensor in plan.tensors:
        mine = torch.frombuffer(bytearray(ours[tensor.name]), dtype=torch.bfloat16)
        reference = torch.frombuffer(bytearray(theirs[tensor.name]), dtype=torch.bfloat16)
        whole = tensor.op.endswith("_rows") or len(mine) <= chunk
        if whole:
            assert ours[tensor.name] == theirs[tensor.name], tensor.name
        else:
            long_vectors += 1
            assert_within_ulps(mine, reference, name=tensor.name)
    by_rows = all(t.op.endswith("_rows") for t in plan.tensors)
    assert (long_vectors > 0) == (chunk == SMALL_CHUNK and not by_rows)


@pytest.mark.parametrize("method", ["nuslerp", "model_stock"])
def test_cpu_kernels_equal_the_torch_kernels_into_float16(llama32: Family, method: str) -> None:
    """float32 inputs written as float16: the same bytes from both kernels."""
    from engine.kernels.angle import AngleKernels
    from engine.kernels.torch_kernels import Kernels

    data = {"method": method, "base": llama32.base, "models": [llama32.task, llama32.language],
            "output": {"dtype": "float16"}}  # fmt: skip
    plan = make_plan(parse_recipe(stringify(data)), resolve=Path)
    try:
        ours = _kernel_outputs(plan, AngleKernels(plan, chunk_elements=2 * 1024 * 1024))
        theirs = _kernel_outputs(plan, Kernels(plan, device="cpu", chunk_elements=2 * 1024 * 1024))
    finally:
        plan.close()
    assert {t.dtype for t in plan.tensors} == {"F16"}
    assert ours == theirs


def test_outputs_load_and_run(llama: Family, run_merge: Any) -> None:
    for recipe in (
        {"method": "nuslerp", "base": llama.base, "models": [llama.task, llama.language]},
        {"method": "model_stock", "base": llama.base,
         "models": [llama.task, llama.language, llama.language2]},
    ):  # fmt: skip
        result = run_merge(recipe)
        assert result.manifest["recipe"]["method"] == recipe["method"]
        assert_forward_pass(result.out_dir)


def test_switches_vary_by_tensor_and_layer(llama: Family, run_merge: Any) -> None:
    """filter_wise by name filter, nuslerp_flatten as a gradient of booleans: each tensor gets
    the switch mergekit would give it (a boolean gradient picks anchor int(position·(n−1)))."""
    recipe = {
        "method": "model_stock",
        "base": llama.base,
        "models": [llama.task, llama.language],
        "params": {"filter_wise": [{"filter": "mlp", "value": True}, {"value": False}]},
    }
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    plan.close()
    ops = {t.name: t.op for t in plan.tensors}
    assert ops["model.layers.0.mlp.up_proj.weight"] == "model_stock_rows"
    assert ops["model.layers.0.self_attn.q_proj.weight"] == "model_stock"
    result = run_merge(recipe)
    base, models = load(llama.base), [load(llama.task), load(llama.language)]
    out = load(result.out_dir)
    for name in ("model.layers.3.mlp.up_proj.weight", "model.layers.3.self_attn.q_proj.weight"):
        along = "rows" if "mlp" in name else "tensor"
        expected = model_stock(base[name], [m[name] for m in models], along)
        assert_within_ulps(out[name], expected.float(), name=name)

    gradient = {"method": "nuslerp", "models": [llama.task, llama.language],
                "params": {"nuslerp_flatten": [True, False]}}  # fmt: skip
    plan = make_plan(parse_recipe(stringify(gradient)), resolve=Path)
    plan.close()
    by_layer = {t.layer: t.op for t in plan.tensors if t.name.endswith("q_proj.weight")}
    assert by_layer == {0: "nuslerp", 1: "nuslerp", 2: "nuslerp", 3: "nuslerp", 4: "nuslerp",
                        5: "nuslerp_rows"}  # fmt: skip
    non_layer = {t.op for t in plan.tensors if t.layer is None}
    assert non_layer == {"nuslerp"}  # at position 0, as mergekit places them


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"method": "model_stock", "base": "b", "models": ["a"]}, "models"),
        ({"method": "model_stock", "models": ["a", "c"]}, "base"),
        ({"method": "model_stock", "base": "b", "models": ["a", "b"]}, "models.1"),
        ({"method": "model_stock", "base": "b", "models": ["a", "c"],
          "params": {"filter_wise": "maybe"}}, "params.filter_wise"),
        ({"method": "nuslerp", "models": ["a", "b", "c"]}, "models"),
        ({"method": "nuslerp", "models": ["a"]}, "models"),
        ({"method": "nuslerp", "models": ["a", "b"], "params": {"weights": [1.0]}},
         "params.weights"),
        ({"method": "nuslerp", "models": ["a", "b"], "params": {"weight": [1.0, 2.0]}},
         "params.weight"),
        ({"method": "nuslerp", "base": "a", "models": ["a", "b"]}, "models.0"),
        ({"method": "nuslerp", "models": ["a", "b"],
          "params": {"nuslerp_row_wise": [{"filter": "mlp", "value": 0.5}]}},
         "params.nuslerp_row_wise.0.value"),  # the condition's value: not a boolean
    ],
    ids=["stock-one-model", "stock-no-base", "stock-base-in-models", "stock-switch",
         "nuslerp-three", "nuslerp-one", "nuslerp-weights", "nuslerp-unknown-param",
         "nuslerp-base-in-models", "nuslerp-switch-condition"],
)  # fmt: skip
def test_invalid_recipes_name_their_field(recipe: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe(recipe)
    assert error.value.details["field"] == field, error.value


@pytest.mark.parametrize(
    ("recipe", "field"),
    [
        ({"method": "model_stock", "params": {"filter_wise": [{"filter": "mlp", "value": True}]}},
         "params.filter_wise"),
        ({"method": "nuslerp", "params": {"weights": [[{"filter": "mlp", "value": 1.0}], 1.0]}},
         "params.weights.0"),
    ],
    ids=["stock-switch", "nuslerp-weight"],
)  # fmt: skip
def test_unmatched_filters_are_refused_at_plan_time(
    llama: Family, run_merge: Any, recipe: dict[str, Any], field: str
) -> None:
    data = {**recipe, "base": llama.base, "models": [llama.task, llama.language]}
    with pytest.raises(RecipeError) as error:
        run_merge(data)
    assert error.value.details["field"] == field
    assert "no filter matches" in error.value.message


@pytest.mark.parametrize("models", [2, 3, 4])
def test_model_stock_coefficients_without_torch_equal_torchs(models: int) -> None:
    """A vector measured by its moments gets t and 1 − t computed without torch (so that torch
    loads meanwhile): the same float32 bits as angles.ModelStock's torch steps, for 1, 3 and 6
    pairs, including a singular denominator (cos θ = −1/(N − 1)) and a zero task vector."""
    from engine.kernels.angle_rules import ModelStockTerms
    from engine.kernels.angle_torch import ModelStock
    from engine.plan.model import TensorPlan, Term

    terms = (*(Term(i, 1 / models) for i in range(models)), Term(models, 1.0))
    tensor = TensorPlan("w", (64,), "F32", "model_stock", terms, None, "model_stock")
    ours, theirs = ModelStockTerms(tensor), ModelStock(tensor)
    generator = torch.Generator().manual_seed(models)
    cases = []
    for _ in range(50):
        vectors = torch.randn(models, 64, generator=generator, dtype=torch.float64)
        cases.append(vectors @ vectors.T)  # a Gram matrix: Σ vᵢ·vⱼ
    opposed = torch.eye(models, dtype=torch.float64)  # every cos θ = −1/(N − 1): singular
    opposed[~torch.eye(models, dtype=torch.bool)] = -1 / (models - 1)
    cases.append(opposed)
    cases.append(torch.zeros(models, models, dtype=torch.float64))  # no task vector at all
    for gram in cases:
        moments = [float(gram[i, j]) for i, j in ours.pairs]
        by_pair = {
            pair: torch.tensor(m, dtype=torch.float64)
            for pair, m in zip(ours.pairs, moments, strict=True)
        }
        expected = theirs.coefficients(theirs.angle_from_moments(by_pair).to(torch.float32))
        table = ours.table_from_moments(torch.tensor(moments, dtype=torch.float64).numpy())
        assert table.dtype.name == "float32"
        assert table.tobytes() == torch.stack([c.reshape(-1) for c in expected]).numpy().tobytes()
