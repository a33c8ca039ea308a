"""TIES with `rescale` against mergekit 0.1.5: each trimmed delta multiplied by
‖δ‖₁ / ‖trimmed δ‖₁ (its L1 norms summed over the whole tensor), in float32 and in mergekit's
bfloat16 arithmetic, whole tensors and in chunks; and the compiled CPU kernels against the
torch ones.

float32: mergekit sums the norms in float32, Layerswap exactly (rounded once), so the scales may
differ in their last bit; the results then differ by the rounding of that scale (and where |δ|
ties at the cut, which mergekit's sort orders as it happens to). bfloat16: the norms are torch's
own sums of the whole tensor, as mergekit's, so the bytes are mergekit's for tensors sorted
whole (the default chunks); in small chunks a larger tensor's selection keeps the first of
equal |δ| at the cut and its norms are exact sums rounded to bf16 (here equal to torch's).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine.planner import make_plan
from tests.conftest import Family, _family
from tests.engine.mergekit_parity import family_config, run_mergekit, translated_merge
from tests.engine.sparsify_reference import setting_value, tie_ambiguous
from tests.engine.test_sparsify import assert_kernels_agree
from tests.reference import assert_within_ulps, load

NAMES = ["task", "language", "task2"]
PER_MODEL = [
    {"weight": 1.0, "density": 0.5},
    {"weight": 0.6, "density": [0.3, 0.8]},  # by layer
    {"weight": 0.8, "density": 0.7},
]
SHARED = {"rescale": True, "normalize": True, "lambda": 1.2}
BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@pytest.fixture(scope="module")
def llama16(tmp_path_factory: pytest.TempPathFactory) -> Family:
    """fp16 Llama, 6 layers (conftest's llama in float16)."""
    return _family(tmp_path_factory.mktemp("llama16"), dtype=torch.float16, seed=50)


def _config(fam: Family, dtype: str, **shared: Any) -> dict[str, Any]:
    models = list(zip(NAMES, PER_MODEL, strict=True))
    return family_config(
        "ties", fam, models, dtype, dtype=dtype, base_model=str(fam.base),
        parameters={**SHARED, **shared},
    )  # fmt: skip


def _tied_at_the_cut(fam: Family, name: str, dtype: torch.dtype) -> torch.Tensor:
    """Entries whose fate hangs on how a sort orders equal |δ| (in `dtype`) at a cut."""
    base = load(fam.base)[name].to(dtype)
    found = torch.zeros_like(base, dtype=torch.bool)
    for model, p in zip(NAMES, PER_MODEL, strict=True):
        delta = (load(getattr(fam, model))[name].to(dtype) - base).float()
        found |= tie_ambiguous(delta, setting_value(p["density"], name, fam.num_layers), 0.0)
    return found


def _differing(ours: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor]) -> dict[str, Any]:
    assert set(ours) == set(theirs)
    found = {}
    for name, tensor in ours.items():
        bits = BITS[tensor.dtype]
        differ = tensor.view(bits) != theirs[name].view(bits)
        if differ.any():
            found[name] = differ
    return found


def test_translated_rescale_reaches_the_recipe(llama32: Family) -> None:
    """mergekit's `rescale: true` is taken, not refused, and plans the sparsifying kernels'
    magnitude dropping with sign consensus; without it, TIES's own kernels."""
    from engine.mergekit import translate

    for rescale in (True, False):
        config = _config(llama32, "float32", rescale=rescale)
        recipe = translate(config, is_local=lambda ref: Path(ref).is_dir()).recipe
        plan = make_plan(recipe, resolve=Path)
        plan.close()
        ops = {t.op for t in plan.tensors} - {"copy"}
        if rescale:
            assert ops == {"sparsify"} and plan.ties is None and plan.sparsify is not None
            assert (plan.sparsify.dropping, plan.sparsify.consensus) == ("magnitude", True)
            assert plan.sparsify.rescale and plan.sparsify.normalize
        else:
            assert ops == {"ties"} and plan.sparsify is None and plan.ties is not None


def test_float32_within_rounding_of_mergekit_whole_and_chunked(
    llama32: Family, run_merge: Any, tmp_path: Path
) -> None:
    """Whole tensors and chunks of 1000 elements give the same bytes (exact norms); each
    element is within a few float32 roundings of mergekit's (4·eps of the terms' magnitude:
    its scales may differ in their last bit), but where |δ| ties at the cut; and rescaling did
    change the result."""
    config = _config(llama32, "float32")
    whole = load(translated_merge(config, run_merge))
    chunked = load(translated_merge(config, run_merge, chunk_elements=1000))
    assert not _differing(whole, chunked)
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    plain = load(run_mergekit(_config(llama32, "float32", rescale=False), tmp_path / "plain"))
    base, inputs = load(llama32.base), [load(getattr(llama32, m)) for m in NAMES]
    eps = torch.finfo(torch.float32).eps
    equal = 0
    for name, tensor in whole.items():
        equal += torch.equal(tensor.view(torch.int32), theirs[name].view(torch.int32))
        tied = _tied_at_the_cut(llama32, name, torch.float32)
        # each scale ≤ 1/density (the kept are the largest), Σ of agreeing weights ≥ 0.6
        magnitude = base[name].abs() + sum(
            1.2 * p["weight"] / 0.6 / setting_value(p["density"], name, llama32.num_layers)
            * (m[name] - base[name]).abs()
            for m, p in zip(inputs, PER_MODEL, strict=True)
        )  # fmt: skip
        assert_within_ulps(tensor[~tied], theirs[name][~tied], 1, name, 4 * eps * magnitude[~tied])
    print(f"{equal}/{len(whole)} tensors equal mergekit's bit for bit")
    moved = [n for n in whole if not torch.equal(whole[n], plain[n])]
    assert len(moved) >= len(whole) - 4  # every merged tensor (norms and all) was rescaled


@pytest.mark.parametrize("chunk_elements", [None, 1000])
def test_bf16_arithmetic_equals_mergekit(
    chunk_elements: int | None, llama: Family, run_merge: Any, tmp_path: Path
) -> None:
    """mergekit's bf16 arithmetic (`dtype: bfloat16`): equal bits with the default chunks;
    in chunks of 1000, tensors over 8 chunks are selected from without sorting them whole, and
    differ only where |δ| ties at the cut, which mergekit's sort orders as it happens to (the
    kept |δ| are then the same values, so their norm too; the exact norms rounded to bf16 are
    torch's sums here)."""
    config = _config(llama, "bfloat16")
    options = {"chunk_elements": chunk_elements} if chunk_elements else {}
    ours = load(translated_merge(config, run_merge, **options))
    theirs = load(run_mergekit(config, tmp_path / "mergekit"))
    differing = _differing(ours, theirs)
    print(f"{len(ours) - len(differing)}/{len(ours)} tensors equal mergekit's bit for bit")
    if chunk_elements is None:
        assert not differing, sorted(differing)
        return
    for name, differ in differing.items():
        assert ours[name].numel() > 8 * chunk_elements, name  # tensors sorted whole are equal
        tied = _tied_at_the_cut(llama, name, torch.bfloat16)
        assert not (differ & ~tied).any(), f"{name}: differs beyond tied |δ| at the cut"
    assert differing  # bf16 deltas tie: the selections did differ


def test_fp16_arithmetic_equals_mergekit(llama16: Family, run_merge: Any, tmp_path: Path) -> None:
    """mergekit's fp16 arithmetic (`dtype: float16`): equal bits."""
    config = _config(llama16, "float16")
    ours = load(translated_merge(config, run_merge))
    differing = _differing(ours, load(run_mergekit(config, tmp_path / "mergekit")))
    assert not differing, sorted(differing)


def _kernel_recipes(llama: Family, llama32: Family) -> list[dict[str, Any]]:
    params = {"weights": [1.0, 0.6], "density": [0.5, [0.3, 0.8]], "rescale": True,
              "lambda": 1.2}  # fmt: skip
    return [
        {"method": "ties", "base": fam.base, "models": [fam.task, fam.language],
         "params": params, **extra}
        for fam, extra in ((llama32, {}), (llama, {"output": {"dtype": "float32"}}))
    ]  # fmt: skip


@pytest.mark.parametrize("chunk_elements", [1000, 1 << 20])
def test_compiled_and_torch_kernels_write_the_same_bytes(
    llama: Family, llama32: Family, chunk_elements: int
) -> None:
    """sparse.py (numba, the CPU path) and sparse_torch.py (the CUDA path), bit for bit, for
    TIES's magnitude dropping in float32."""
    assert_kernels_agree(_kernel_recipes(llama, llama32), chunk_elements)
