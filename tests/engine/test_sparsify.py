"""The sparsifying methods (dare_*, breadcrumbs*, della*) against plain-torch references given
the engine's random bits, their determinism, the two kernel families, and recipe errors."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.errors import RecipeError
from engine.kernels.exact_sums import FLOAT32, FLOAT64, rounded_sum
from engine.kernels.random_bits import philox4x32, random_bits, stream_key
from engine.kernels.sparse import SparseKernels
from engine.kernels.sparse import handles as sparse_handles
from engine.kernels.sparse_torch import exact_bins
from engine.kernels.torch_kernels import Kernels
from engine.planner import make_plan
from engine.recipe import parse_recipe
from tests.conftest import Family, _family
from tests.engine.sparsify_reference import (
    Merge,
    bits_of,
    breadcrumbs_mask,
    dare_mask,
    della_mask,
    gradient,
    sparse_merge,
)
from tests.engine.test_output import assert_forward_pass
from tests.helpers import stringify
from tests.reference import assert_equal, assert_within_ulps, layer_of, load, sha256

# method -> (consensus, default normalize, default rescale)
METHODS = {
    "dare_ties": (True, False, True),
    "dare_linear": (False, False, True),
    "breadcrumbs": (False, False, False),
    "breadcrumbs_ties": (True, False, False),
    "della": (True, True, True),
    "della_linear": (False, False, True),
}
# Each method with its defaults, and with every switch turned and per-model amounts.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("dare_ties", {"density": 0.3}),
    ("dare_ties", {"density": [0.2, 0.7], "weights": [1.0, 0.6], "normalize": True,
                   "rescale": False, "lambda": 1.3, "seed": 11}),
    ("dare_linear", {"density": 0.5, "weights": [0.6, 0.8]}),
    ("dare_linear", {"density": 0.4, "normalize": True, "rescale": False}),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.05, "weights": [0.7, 0.4]}),
    ("breadcrumbs", {"density": [0.9, 0.6], "gamma": [0.01, 0.2], "normalize": True,
                     "rescale": True}),
    ("breadcrumbs_ties", {"density": 0.5, "gamma": 0.1, "weights": [1.0, 0.6],
                          "normalize": True, "lambda": 0.8}),
    ("della", {"density": 0.5, "epsilon": 0.2}),
    ("della", {"density": [0.4, 1.0], "epsilon": [0.1, 0.3], "normalize": False,
               "weights": [0.5, 1.5], "seed": 3}),
    ("della_linear", {"density": 0.6, "epsilon": 0.05, "rescale": False, "lambda": 0.9}),
]  # fmt: skip
PAIR = ("task", "language")


def _recipe(
    fam: Family, method: str, params: dict[str, Any], models: tuple[str, ...] = PAIR
) -> dict[str, Any]:
    return {
        "method": method,
        "base": fam.base,
        "models": [getattr(fam, m) for m in models],
        "params": params,
    }


def _per_model(value: Any, count: int) -> list[Any]:
    return list(value) if isinstance(value, list) else [value] * count


def expected_tensors(
    fam: Family, method: str, params: dict[str, Any], models: tuple[str, ...] = PAIR
) -> dict[str, torch.Tensor]:
    """Every tensor as the reference makes it (amounts may be gradients over the layers)."""
    consensus, normalize, rescale = METHODS[method]
    base = load(fam.base)
    inputs = [load(getattr(fam, m)) for m in models]
    count, layers = len(models), fam.num_layers
    seed = params.get("seed", 0)

    def at(value: Any, layer: int | None) -> float:
        return gradient(value, layer, layers) if isinstance(value, list) else float(value)

    how_defaults = {"normalize": normalize, "rescale": rescale}
    out = {}
    for name, b in base.items():
        layer = layer_of(name)
        lambda_ = at(params.get("lambda", 1.0), layer)
        how = Merge(consensus, params.get("normalize", how_defaults["normalize"]),
                    params.get("rescale", how_defaults["rescale"]), lambda_)  # fmt: skip
        weights = [at(w, layer) for w in _per_model(params.get("weights", 1.0), count)]
        densities = [at(d, layer) for d in _per_model(params.get("density", 0.5), count)]
        masks: list[torch.Tensor | None] = []
        for i, (model, density) in enumerate(zip(inputs, densities, strict=True)):
            delta = model[name].float() - b.float()
            if density >= 1.0:
                masks.append(None)
            elif method.startswith("dare"):
                masks.append(dare_mask(delta, density, seed, name, i))
            elif method.startswith("breadcrumbs"):
                gamma = at(_per_model(params.get("gamma", 0.01), count)[i], layer)
                masks.append(breadcrumbs_mask(delta, density, gamma))
            else:
                epsilon = at(_per_model(params.get("epsilon", 0.15), count)[i], layer)
                masks.append(della_mask(delta, density, epsilon, seed, name, i))
        merged = sparse_merge(b, [m[name] for m in inputs], weights, masks, how)
        out[name] = merged.to(b.dtype)
    return out


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize(("method", "params"), CASES, ids=[f"{m}-{i}" for i, (m, _) in
                                                          enumerate(CASES)])  # fmt: skip
def test_matches_reference(
    method: str, params: dict[str, Any], family_name: str, request: pytest.FixtureRequest,
    run_merge: Any,
) -> None:  # fmt: skip
    fam: Family = request.getfixturevalue(family_name)
    out = load(run_merge(_recipe(fam, method, params)).out_dir)
    expected = expected_tensors(fam, method, params)
    assert set(out) == set(expected)
    base = load(fam.base)
    for name, tensor in expected.items():
        assert_equal(out[name], tensor, name)
    assert sum(not torch.equal(out[n], base[n]) for n in out) > len(out) // 2


def test_three_models_with_gradients_and_filters(llama32: Family, run_merge: Any) -> None:
    """Per-layer weights, densities and λ (gradients, {filter, value}s) resolve per tensor."""
    models = ("task", "language", "language2")
    params = {
        "weights": [[0.2, 1.0], 0.5, [{"filter": "mlp", "value": 0.3}, {"value": 0.9}]],
        "density": [[0.2, 0.8], 0.5, 0.7],
        "lambda": [1.2, 0.8],
        "normalize": True,
    }
    result = run_merge(_recipe(llama32, "dare_ties", params, models))
    out = load(result.out_dir)
    base, inputs = load(llama32.base), [load(getattr(llama32, m)) for m in models]
    layers = llama32.num_layers
    for name, b in base.items():
        layer = layer_of(name)
        weights = [gradient([0.2, 1.0], layer, layers), 0.5, 0.3 if "mlp" in name else 0.9]
        densities = [gradient([0.2, 0.8], layer, layers), 0.5, 0.7]
        masks: list[torch.Tensor | None] = [
            dare_mask(m[name].float() - b.float(), d, 0, name, i)
            for i, (m, d) in enumerate(zip(inputs, densities, strict=True))
        ]
        how = Merge(True, True, True, gradient([1.2, 0.8], layer, layers))
        expected = sparse_merge(b, [m[name] for m in inputs], weights, masks, how)
        assert_equal(out[name], expected.to(b.dtype), name)
    assert result.manifest["resolved_weights"] == {"weights": ["varies", 0.5, "varies"], "seed": 0}


def test_drops_keep_about_density_and_rescale_by_the_l1_norms(
    llama32: Family, run_merge: Any
) -> None:
    """One model, weight 1, no consensus effect: out − base is the thinned delta, kept entries
    scaled by ‖δ‖₁ / ‖kept‖₁ (≈ 1/density); about `density` of them kept."""
    kept = total = 0
    for method, extra in (("dare_linear", {}), ("della_linear", {"epsilon": 0.2})):
        params = {"density": 0.3, **extra}
        out = load(run_merge(_recipe(llama32, method, params, ("task",))).out_dir)
        base, task = load(llama32.base), load(llama32.task)
        for name, b in base.items():
            if b.dim() != 2:
                continue
            delta = task[name] - b
            moved = out[name] - b
            keep = moved != 0
            kept, total = kept + int(keep.sum()), total + keep.numel()
            scale = delta.double().abs().sum() / delta[keep].double().abs().sum()
            expected = b.double() + torch.where(keep, delta.double() * scale, 0.0)
            # float32 steps: (δ·mask)·scale, then + base (slack where that cancels)
            slack = 4 * torch.finfo(torch.float32).eps * (b.abs() + delta.abs() * float(scale))
            assert_within_ulps(out[name], expected.float(), ulps=1, name=name, slack=slack)
        assert abs(kept / total - 0.3) < 0.01, (method, kept / total)


def test_della_keeps_larger_deltas_more_often(llama32: Family, run_merge: Any) -> None:
    """Keep probability rises with the rank of |δ| in its row: density ∓ 2ε/3 on average over
    the smallest and the largest third."""
    params = {"density": 0.5, "epsilon": 0.3, "rescale": False}
    out = load(run_merge(_recipe(llama32, "della_linear", params, ("task",))).out_dir)
    base, task = load(llama32.base), load(llama32.task)
    low = high = count = 0
    for name, b in base.items():
        if b.dim() != 2:
            continue
        ranks = (task[name] - b).abs().argsort(dim=1).argsort(dim=1)
        kept = out[name] != b
        third = b.shape[1] // 3
        low += int(kept[ranks < third].sum())
        high += int(kept[ranks >= b.shape[1] - third].sum())
        count += int((ranks < third).sum())
    assert abs(low / count - 0.3) < 0.015 and abs(high / count - 0.7) < 0.015, (low, high, count)


@pytest.mark.parametrize("method", list(METHODS))
def test_same_recipe_same_bytes_whatever_the_chunks(
    method: str, llama: Family, run_merge: Any
) -> None:
    """1000-element chunks (every matrix in several) give the bytes of the default chunks, and
    the same recipe again the same bytes; for random drops another seed gives other bytes, and
    the seed is recorded in the plan and the manifest."""
    params = {"density": 0.4, **({"epsilon": 0.1} if method.startswith("della") else {})}
    recipe = _recipe(llama, method, params)
    runs = [run_merge(recipe, chunk_elements=1000), run_merge(recipe), run_merge(recipe)]
    random = not method.startswith("breadcrumbs")
    if random:
        runs.append(run_merge({**recipe, "params": {**params, "seed": 1}}))
    digests = [sha256(r.out_dir / "model.safetensors") for r in runs]
    assert digests[0] == digests[1] == digests[2]
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    plan.close()
    assert plan.to_dict()["sparsify"]["seed"] == (0 if random else None)
    if random:
        assert digests[3] != digests[0]
        assert runs[1].manifest["resolved_weights"]["seed"] == 0
        assert runs[3].manifest["resolved_weights"]["seed"] == 1


@pytest.fixture(scope="module")
def llama16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """float16 inputs (widened by numpy, not bit-shifted as BF16 is)."""
    return _family(tmp_path_factory.mktemp("llama16"), dtype=torch.float16, layers=2, seed=30)


@pytest.fixture(scope="module")
def llama64(tmp_path_factory: pytest.TempPathFactory) -> Family:
    return _family(tmp_path_factory.mktemp("llama64"), dtype=torch.float64, layers=2, seed=40)


def _kernel_recipes(fam: Family, fam32: Family, fam16: Family) -> list[dict[str, Any]]:
    three = ("task", "language", "language2")
    return [
        _recipe(fam, "dare_ties", {"density": 0.3}),
        _recipe(fam, "dare_linear", {"density": [0.3, 1.0], "normalize": True}, three[:2]),
        _recipe(fam, "breadcrumbs_ties", {"density": 0.6, "gamma": 0.1, "rescale": True}),
        _recipe(fam, "della", {"density": 0.5, "epsilon": 0.2, "weights": [0.3, 1.0, 2.0]},
                three),
        _recipe(fam32, "breadcrumbs", {"density": 0.7, "gamma": 0.05, "lambda": 1.4}),
        _recipe(fam32, "della_linear", {"density": 0.4, "epsilon": 0.3}),
        {**_recipe(fam, "dare_ties", {"density": 0.5}), "output": {"dtype": "float16"}},
        {**_recipe(fam32, "della", {"density": 0.5}), "output": {"dtype": "bfloat16"}},
        _recipe(fam16, "dare_ties", {"density": 0.7}),
        _recipe(fam16, "breadcrumbs", {"density": 0.7}),
    ]  # fmt: skip


def _bytes(kernels: Any, tensor: Any) -> bytes:
    return b"".join(bytes(chunk) for chunk in kernels.output_bytes(tensor))


def assert_kernels_agree(recipes: list[dict[str, Any]], chunk_elements: int) -> None:
    """sparse.py (numba, the CPU path) and sparse_torch.py (the CUDA path) write the same
    bytes for every sparsified tensor of each recipe."""
    for recipe in recipes:
        plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
        try:
            assert sparse_handles(plan, "cpu") and not sparse_handles(plan, "cuda")
            compiled = SparseKernels(plan, chunk_elements=chunk_elements)
            reference = Kernels(plan, device="cpu", chunk_elements=chunk_elements)
            computed = [t for t in plan.tensors if t.op == "sparsify"]
            assert computed
            for tensor in computed:
                assert _bytes(compiled, tensor) == _bytes(reference, tensor), (
                    recipe["method"],
                    tensor.name,
                )
        finally:
            plan.close()


# 2500: each layer weight in 2 to 4 chunks of whole rows, the embedding in 7; 1 << 20: whole.
@pytest.mark.parametrize("chunk_elements", [2500, 1 << 20])
def test_compiled_and_torch_kernels_write_the_same_bytes(
    llama: Family, llama32: Family, llama16: Family, chunk_elements: int
) -> None:
    """sparse_kernels (numba, the CPU path) and sparse_torch (the CUDA path), bit for bit."""
    assert_kernels_agree(_kernel_recipes(llama, llama32, llama16), chunk_elements)


@pytest.mark.parametrize("method", ["dare_ties", "breadcrumbs_ties", "della"])
def test_float64_inputs_are_merged_in_float64_whatever_the_chunks(
    method: str, llama64: Family, run_merge: Any
) -> None:
    """F64 checkpoints go to the torch path, which computes in float64 (64-bit selection
    keys, float64 exact sums): the same bytes for any chunk size."""
    fam = llama64
    params = {"density": 0.4, "rescale": True, **({"gamma": 0.1} if "crumbs" in method else {})}
    recipe = _recipe(fam, method, params)
    plan = make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    plan.close()
    assert not sparse_handles(plan, "cpu")
    small, large = run_merge(recipe, chunk_elements=1000), run_merge(recipe)
    assert sha256(small.out_dir / "model.safetensors") == sha256(
        large.out_dir / "model.safetensors"
    )
    out, base = load(large.out_dir), load(fam.base)
    assert all(t.dtype == torch.float64 for t in out.values())
    assert sum(not torch.equal(out[n], base[n]) for n in out) == len(out)


def test_della_ranks_a_3d_tensor_along_its_second_dimension() -> None:
    """As mergekit's MagPrune: a tensor of more than two dimensions is ranked along dim 1, for
    each index of the others (the torch path; the compiled one leaves such plans to it)."""
    from engine.kernels.sparse_torch import SparseMerge
    from engine.plan.model import SparsifySettings, TensorPlan, Term, Thinning

    generator = torch.Generator().manual_seed(3)
    base = torch.randn(4, 50, 3, generator=generator)
    model = base + torch.randn(4, 50, 3, generator=generator)
    inputs = {0: model.reshape(-1), 1: base.reshape(-1)}
    thinning = Thinning(densities=(0.5,), lambda_=1.0, epsilons=(0.3,))
    tensor = TensorPlan("w", (4, 50, 3), "F32", "sparsify", (Term(0, 1.0),), None, "della",
                        thinning=thinning)  # fmt: skip
    settings = SparsifySettings(1, "magprune", False, False, False, seed=8)
    merge = SparseMerge(lambda s, at, n: inputs[s][at : at + n].clone(), tensor, settings, 64)
    got = torch.cat([merge.chunk(at, min(64, 600 - at)) for at in range(0, 600, 64)])
    delta = model - base
    ranks = torch.sort(delta.abs(), dim=1, stable=True).indices.argsort(dim=1)
    p = torch.tensor(0.5 - 0.3, dtype=torch.float32) + ranks.float() / 49.0 * 2 * 0.3
    bits = bits_of(8, "w", 0, 600).double()
    keep = bits < p.reshape(-1).double() * 2.0**32
    expected = base.reshape(-1) + delta.reshape(-1) * keep.float()
    assert_equal(got, expected, "w")


def test_aligned_vocabularies(tmp_path_factory: pytest.TempPathFactory, run_merge: Any) -> None:
    """tokenizer_source: union: the embedding and head are merged row by row in the output
    vocabulary (the base's row filling a token a model lacks), masks drawn at the output's
    element indices; the model runs."""
    from tests.engine.vocabularies import aligned, embedding_names, make_chat_family, vocabulary

    chat = make_chat_family(tmp_path_factory.mktemp("chat"), dtype=torch.bfloat16)
    recipe = {"method": "dare_ties", "base": chat.base, "models": [chat.chat, chat.tool],
              "params": {"density": 0.4, "weights": [1.0, 0.8]},
              "tokenizer_source": "union"}  # fmt: skip
    result = run_merge(recipe)
    paths = [chat.chat, chat.tool, chat.base]
    out, output = load(result.out_dir), vocabulary(result.out_dir)
    inputs, vocabularies = [load(p) for p in paths], [vocabulary(p) for p in paths]
    names = embedding_names(out)
    assert names
    for name in names:
        rows = aligned(output, vocabularies, [t[name] for t in inputs], base=2)
        masks: list[torch.Tensor | None] = [
            dare_mask(rows[i].float() - rows[2].float(), 0.4, 0, name, i) for i in range(2)
        ]
        expected = sparse_merge(rows[2], rows[:2], [1.0, 0.8], masks, Merge(True, False, True))
        assert_equal(out[name], expected.to(rows[2].dtype), name)
    assert_forward_pass(result.out_dir)


def test_merged_model_loads_and_runs(llama: Family, run_merge: Any) -> None:
    result = run_merge(_recipe(llama, "della", {"density": 0.5, "epsilon": 0.1}))
    assert_forward_pass(result.out_dir)


# -- the pieces ---------------------------------------------------------------------------------
def test_philox_known_answers_and_any_chunk() -> None:
    """Random123's known-answer vectors for Philox4x32-10, and a stream made in any pieces."""
    assert philox4x32((0, 0, 0, 0), (0, 0)) == (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)
    ones = 0xFFFFFFFF
    assert philox4x32((ones,) * 4, (ones, ones)) == (
        0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD
    )  # fmt: skip
    pi = ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0))
    assert philox4x32(*pi) == (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)
    whole = random_bits(5, "w", 1, 0, 1001)
    pieces = [random_bits(5, "w", 1, s, min(7, 1001 - s)) for s in range(0, 1001, 7)]
    assert np.array_equal(whole, np.concatenate(pieces))
    assert np.array_equal(random_bits(5, "w", 1, 3, 10), whole[3:13])
    assert not np.array_equal(random_bits(6, "w", 1, 0, 1001), whole)
    assert stream_key(5, "w", 1) != stream_key(5, "w", 2)
    assert torch.equal(bits_of(5, "w", 1, 1001), torch.from_numpy(whole.astype("int64")))
    assert abs(float(whole.astype(np.float64).mean()) / 2**32 - 0.5) < 0.03


def test_philox_in_torch_equals_compiled() -> None:
    from engine.kernels.sparse_torch import philox_bits

    key = stream_key(9, "model.layers.0.mlp.up_proj.weight", 0)
    for start, count in ((0, 1), (1, 6), (3, 1000), (2**33 + 1, 17)):
        expected = random_bits(9, "model.layers.0.mlp.up_proj.weight", 0, start, count)
        got = philox_bits(key, start, count, torch.device("cpu"))
        assert torch.equal(got, torch.from_numpy(expected.astype("int64"))), (start, count)


def _bins(values: list[float]) -> list[int]:
    return exact_bins(torch.tensor(values, dtype=torch.float32))


def test_exact_sums_round_once_to_nearest_even() -> None:
    f32 = np.float32
    assert rounded_sum(_bins([1.0, 2.0**-24]), FLOAT32) == 1.0  # halfway: to even
    above = float(np.nextafter(f32(1), f32(2)))
    assert rounded_sum(_bins([1.0, 2.0**-24, 2.0**-40]), FLOAT32) == above
    assert rounded_sum(_bins([1.0 + 2.0**-23, 2.0**-24]), FLOAT32) == 1.0 + 2.0**-22
    assert rounded_sum(_bins([2.0**-149, 2.0**-149]), FLOAT32) == 2.0**-148  # subnormals
    assert rounded_sum(_bins([3e38, 3e38]), FLOAT32) == math.inf
    assert rounded_sum(_bins([1.0, math.inf]), FLOAT32) == math.inf
    assert math.isnan(rounded_sum(_bins([math.inf, math.nan]), FLOAT32))
    values = torch.rand(100_000, dtype=torch.float64).float() * 1e-3
    exact = sum(float(v) for v in values.double().tolist())  # within 1e-16: rounds the same
    assert rounded_sum(_bins(values.tolist()), FLOAT32) == float(f32(exact))
    doubles = torch.rand(20_000, dtype=torch.float64) * 2.0 ** torch.randint(-60, 60, (20_000,))
    exact_double = sum(Fraction(v) for v in doubles.tolist())
    got = rounded_sum(exact_bins(doubles), FLOAT64)
    assert got == float(exact_double)  # Fraction -> float rounds to nearest even
    # any order, any pieces: the same bins
    parts = [_bins(values[i : i + 999].tolist()) for i in range(0, 100_000, 999)]
    summed = [sum(col) for col in zip(*parts, strict=True)]
    assert rounded_sum(summed, FLOAT32) == rounded_sum(_bins(values.flip(0).tolist()), FLOAT32)


# -- recipes ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("method", "params", "field"),
    [
        ("dare_ties", {"density": 0.0}, "params.density"),
        ("dare_ties", {"density": 1.5}, "params.density"),
        ("dare_linear", {"density": [0.5, [0.2, 1.2]]}, "params.density.1"),
        ("dare_ties", {"density": [0.5]}, "params.density"),
        ("dare_ties", {"weights": [1.0]}, "params.weights"),
        ("dare_ties", {"seed": -1}, "params.seed"),
        ("dare_ties", {"gamma": 0.1}, "params.gamma"),
        ("breadcrumbs", {"gamma": 1.0}, "params.gamma"),
        ("breadcrumbs_ties", {"gamma": [0.1, -0.1]}, "params.gamma.1"),
        ("breadcrumbs", {"epsilon": 0.1}, "params.epsilon"),
        ("della", {"density": 0.3, "epsilon": 0.3}, "params.epsilon"),
        ("della_linear", {"density": [0.5, 0.9], "epsilon": [0.1, 0.2]}, "params.epsilon.1"),
        ("della", {"epsilon": 0.5}, "params.epsilon"),
        ("della", {"lambda": "big"}, "params.lambda"),
    ],
)
def test_invalid_recipes_name_their_field(method: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe({"method": method, "base": "b", "models": ["x", "y"], "params": params})
    assert error.value.details["field"] == field, error.value


@pytest.mark.parametrize("method", list(METHODS))
def test_base_is_required(method: str) -> None:
    with pytest.raises(RecipeError) as error:
        parse_recipe({"method": method, "models": ["x", "y"]})
    assert error.value.details["field"] == "base"


def test_della_spread_is_checked_per_tensor(llama32: Family) -> None:
    """density and epsilon that fit at some layers but not at others: refused when the plan is
    made, naming the field and the tensor."""
    recipe = _recipe(llama32, "della", {"density": [[0.1, 0.8], 0.5], "epsilon": 0.15})
    with pytest.raises(RecipeError) as error:
        make_plan(parse_recipe(stringify(recipe)), resolve=Path)
    assert error.value.details["field"] == "params.epsilon"
    assert "model." in str(error.value) or "lm_head" in str(error.value)


def test_defaults_are_mergekits_switches() -> None:
    """normalize and rescale default as in mergekit's registry; density 0.5, seed 0."""
    for method, (_, normalize, rescale) in METHODS.items():
        recipe = parse_recipe({"method": method, "base": "b", "models": ["x"]})
        params = recipe.params  # type: ignore[attr-defined]
        assert (params.normalize, params.rescale, params.density) == (normalize, rescale, 0.5)
        assert params.lambda_ == 1.0 and params.weights == "uniform"
        assert getattr(params, "seed", 0) == 0
