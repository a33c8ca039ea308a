"""TIES (docs/concepts/methods.md) against a whole-tensor reference, incl. the radix-select path."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.conftest import Family
from tests.engine.sparsify_reference import setting_value
from tests.reference import assert_within_ulps, load, sha256, ties, top_k_mask

CASES: dict[str, dict[str, Any]] = {
    "d0.5-normalize": {"density": 0.5, "normalize": True},
    "d1.0-normalize": {"density": 1.0, "normalize": True},
    "d0.5-no-normalize": {"density": 0.5, "normalize": False},
    "d1.0-no-normalize-lambda": {"density": 1.0, "normalize": False, "lambda": 0.6},
    "d0.3-lambda-weights": {"density": 0.3, "lambda": 1.4, "weights": [1.0, 0.5]},
    "d0.5-weights-no-normalize": {"density": 0.5, "normalize": False, "weights": [0.2, 0.9]},
}


def check_ties(fam: Family, models: list[str], params: dict[str, Any], out_dir: Any) -> int:
    """Compare an engine output with the reference; return how many tensors changed."""
    base = load(fam.base)
    inputs = [load(getattr(fam, m)) for m in models]
    weights = params.get("weights", [1.0] * len(models))
    out = load(out_dir)
    assert set(out) == set(base)
    changed = 0
    for name, b in base.items():
        expected = ties(
            b,
            [m[name] for m in inputs],
            weights,
            density=params.get("density", 0.5),
            lambda_=params.get("lambda", 1.0),
            normalize=params.get("normalize", True),
        )
        assert out[name].dtype == b.dtype
        # float32 arithmetic in a possibly different order: at most 1 ulp of the output dtype,
        # with float32 slack where the result cancels to ~0.
        slack = (
            4
            * torch.finfo(torch.float32).eps
            * (
                b.float().abs()
                + sum(
                    w * (m[name].float() - b.float()).abs()
                    for w, m in zip(weights, inputs, strict=True)
                )
            )
        )
        assert_within_ulps(out[name], expected, 1, name, slack)
        changed += int(not torch.equal(out[name], b))
    return changed


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("family_name", ["llama", "llama32"])
def test_ties_matches_reference(
    case: str, family_name: str, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    params = CASES[case]
    result = run_merge(
        {"method": "ties", "base": fam.base, "models": [fam.task, fam.language], "params": params}
    )
    assert check_ties(fam, ["task", "language"], params, result.out_dir) > 0


def test_ties_three_models(llama: Family, run_merge: Any) -> None:
    params = {"density": 0.4, "weights": [0.3, 1.0, 2.0], "lambda": 0.9}
    models = ["task", "language", "language2"]
    result = run_merge(
        {
            "method": "ties",
            "base": llama.base,
            "models": [getattr(llama, m) for m in models],
            "params": params,
        }
    )
    assert check_ties(llama, models, params, result.out_dir) > 0


# Per model: a weight gradient from 0, a weight by tensor name (negative on the MLPs), density
# gradients and a density by tensor name; each tensor's resolved as mergekit resolves them.
VARYING = {
    "weights": [[0.0, 0.6, 1.0], [{"filter": "mlp", "value": -0.35}, {"value": 0.9}], 0.5],
    "density": [[1.0, 0.2], 0.5, [{"filter": "self_attn", "value": 0.8}, {"value": 0.3}]],
    "lambda": 1.1,
}


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
@pytest.mark.parametrize("chunk_elements", [1000, None])
def test_ties_weights_and_densities_that_vary_match_reference(
    family_name: str, chunk_elements: int | None, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    fam: Family = request.getfixturevalue(family_name)
    models = ["task", "language", "language2"]
    options = {"chunk_elements": chunk_elements} if chunk_elements else {}
    recipe = {"method": "ties", "base": fam.base, "models": [getattr(fam, m) for m in models],
              "params": VARYING}  # fmt: skip
    out = load(run_merge(recipe, **options).out_dir)
    base, inputs = load(fam.base), [load(getattr(fam, m)) for m in models]
    eps, trimmed = torch.finfo(torch.float32).eps, set()
    for name, b in base.items():
        weights = [setting_value(s, name, fam.num_layers) for s in VARYING["weights"]]
        densities = [setting_value(s, name, fam.num_layers) for s in VARYING["density"]]
        deltas = [
            (m[name].float() - b.float()) * top_k_mask((m[name].float() - b.float()).abs(), kept)
            for m, kept in zip(inputs, densities, strict=True)
        ]  # trimmed
        expected = ties(b, [m[name] for m in inputs], weights, density=densities, lambda_=1.1,
                        normalize=True)  # fmt: skip
        magnitude = sum(abs(w) * d.abs() for w, d in zip(weights, deltas, strict=True))
        # Where Σ wᵢ·δᵢ cancels to within rounding (bf16 deltas on a grid, weights of both
        # signs), the order of the sum decides the elected sign: not compared.
        total = sum(w * d for w, d in zip(weights, deltas, strict=True))
        decided = (total.abs() > 4 * eps * magnitude) | (magnitude == 0)
        assert int((~decided).sum()) <= max(2, decided.numel() // 100), name
        # the divisor may be a difference of weights (0.9 − 0.35): more float32 slack
        slack = (16 * eps * (b.float().abs() + magnitude))[decided]
        assert_within_ulps(out[name][decided], expected[decided], 1, name, slack)
        trimmed.add(tuple(densities))
    assert len(trimmed) > 3  # the densities did vary from tensor to tensor


def test_ties_density_changes_the_result(llama32: Family, run_merge: Any) -> None:
    """The trim really trims: density 0.5 and 1.0 give different tensors, and at 0.5 about
    half of one expert's deltas are dropped where the other expert is unchanged."""
    recipe = {"method": "ties", "base": llama32.base, "models": [llama32.task, llama32.language]}
    half = load(run_merge({**recipe, "params": {"density": 0.5}}).out_dir)
    full = load(run_merge({**recipe, "params": {"density": 1.0}}).out_dir)
    name = "model.layers.2.mlp.down_proj.weight"
    assert not torch.equal(half[name], full[name])
    # With a single expert and no normalisation: out − base = λ·trimmed delta.
    single = run_merge(
        {
            "method": "ties",
            "base": llama32.base,
            "models": [llama32.task],
            "params": {"density": 0.5, "normalize": False},
        }
    )
    base, task = load(llama32.base), load(llama32.task)
    moved = load(single.out_dir)[name] != base[name]
    assert int(moved.sum()) == int(0.5 * moved.numel())
    magnitudes = (task[name] - base[name]).abs()
    assert float(magnitudes[moved].min()) >= float(magnitudes[~moved].max())


@pytest.mark.parametrize("family_name", ["llama", "llama32"])
def test_ties_radix_select_path(
    family_name: str, request: pytest.FixtureRequest, run_merge: Any
) -> None:
    """With 1000-element chunks every matrix takes the exact multi-chunk k-th-largest path;
    the result must still match the reference, and byte-for-byte the single-chunk result."""
    fam: Family = request.getfixturevalue(family_name)
    params = {"density": 0.5, "weights": [1.0, 0.7], "lambda": 1.2}
    recipe = {
        "method": "ties",
        "base": fam.base,
        "models": [fam.task, fam.language],
        "params": params,
    }
    chunked = run_merge(recipe, chunk_elements=1000)
    whole = run_merge(recipe)
    assert check_ties(fam, ["task", "language"], params, chunked.out_dir) > 0
    weights = [n for n in chunked.files if n.endswith(".safetensors")]
    assert weights
    for name in weights:
        assert sha256(chunked.out_dir / name) == sha256(whole.out_dir / name)


def test_linear_ops_are_chunk_size_independent(llama: Family, run_merge: Any) -> None:
    recipe = {"method": "soup", "models": [llama.task, llama.language, llama.language2]}
    small = run_merge(recipe, chunk_elements=1000)
    large = run_merge(recipe)
    assert (small.out_dir / "model.safetensors").read_bytes() == (
        large.out_dir / "model.safetensors"
    ).read_bytes()


# -- the k-th largest selection itself -------------------------------------------------------
def _chunked(values: torch.Tensor, size: int) -> Any:
    def chunks() -> Iterator[torch.Tensor]:
        for start in range(0, values.numel(), size):
            yield values[start : start + size]

    return chunks


@pytest.mark.parametrize(
    "values",
    [
        torch.rand(10_000, generator=torch.Generator().manual_seed(0)),
        torch.randn(7_777, generator=torch.Generator().manual_seed(1)).abs(),
        # many duplicates and exact zeros (bf16 deltas look like this)
        torch.randn(5_000, generator=torch.Generator().manual_seed(2))
        .abs()
        .to(torch.bfloat16)
        .float()
        .masked_fill(torch.arange(5_000) % 3 == 0, 0.0),
        torch.full((3_000,), 0.25),
    ],
    ids=["uniform", "halfnormal", "bf16-duplicates-zeros", "constant"],
)
@pytest.mark.parametrize("k_fraction", [0.0001, 0.3, 0.5, 0.999, 1.0])
def test_top_k_selection_is_exact(values: torch.Tensor, k_fraction: float) -> None:
    """Threshold, tie quota and the chunk-by-chunk mask agree with a stable sort, for the
    in-memory path (one chunk; in a fresh buffer or in one kept from an earlier selection) and
    the radix path (many chunks)."""
    from engine.kernels.top_k import keep_mask, top_k
    from tests.reference import kept_count, top_k_mask

    numel = values.numel()
    k = kept_count(k_fraction, numel)
    expected = top_k_mask(values, k_fraction)
    kept = torch.full((numel + 5,), float("nan"))  # a buffer kept from call to call, larger
    for size, buffer in ((1000, None), (numel, None), (numel, kept), (numel, kept)):
        in_memory = numel if size == numel else 0
        top = top_k(_chunked(values, size), k, numel=numel, in_memory=in_memory, buffer=buffer)
        assert top.threshold == float(torch.topk(values, k).values[-1])
        left = top.ties
        masks = []
        for chunk in _chunked(values, size)():
            mask, left = keep_mask(chunk, top, left)
            masks.append(mask)
        assert left == 0
        assert torch.equal(torch.cat(masks), expected)
        assert int(torch.cat(masks).sum()) == k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_top_k_of_narrow_chunks_equals_top_k_of_their_float32_values(dtype: torch.dtype) -> None:
    """Magnitudes in mergekit's bf16/fp16 arithmetic (sce's variances) select as their exact
    float32 values do, in memory and by radix select."""
    from engine.kernels.top_k import top_k

    values = torch.randn(6_000, generator=torch.Generator().manual_seed(3)).abs().to(dtype)
    wide, numel, k = values.float(), values.numel(), 1_234
    for size, in_memory in ((numel, numel), (1000, 0)):
        found = top_k(_chunked(values, size), k, numel=numel, in_memory=in_memory)
        assert found == top_k(_chunked(wide, size), k, numel=numel, in_memory=in_memory)
        assert found.threshold == float(torch.topk(wide, k).values[-1])


def test_ties_sharded_inputs_match_unsharded(llama: Family, sharded: Any, run_merge: Any) -> None:
    params = {"density": 0.5}
    a = run_merge(
        {
            "method": "ties",
            "base": llama.base,
            "models": [llama.task, llama.language],
            "params": params,
        }
    )
    b = run_merge(
        {
            "method": "ties",
            "base": sharded.base,
            "models": [sharded.task, llama.language],
            "params": params,
        }
    )
    assert sha256(a.out_dir / "model.safetensors") == sha256(b.out_dir / "model.safetensors")
