"""TIES's top-k selection on tensors large enough to be sampled: exact whichever way it is
found (sample bounds, a histogram bin, or the full radix select), against a stable sort."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from engine.kernels.ties_selection import Selection, _kth_largest, _sample_bounds
from tests.reference import kept_count, top_k_mask

N = 300_007  # above the sampled size (4 · 16384), odd


def _bf16(values: np.ndarray) -> np.ndarray:
    """BF16 bit patterns (uint16) of float32 values, by truncation (any BF16 values do)."""
    return (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _cases() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(model, base) pairs: BF16 bit patterns or float32, as the kernels receive them."""
    rng = np.random.default_rng(11)
    base = rng.standard_normal(N).astype(np.float32) * 0.02
    fine_tuned = base + rng.standard_normal(N).astype(np.float32) * 0.002
    rows = np.repeat(rng.uniform(0.1, 10, N // 7 + 1), 7)[:N].astype(np.float32)
    spiky = np.where(rng.random(N) < 0.01, 1e30, 0.0).astype(np.float32)
    with_nan = fine_tuned.copy()
    with_nan[rng.choice(N, 50, replace=False)] = np.nan
    return {
        "bf16 fine-tune": (_bf16(fine_tuned), _bf16(base)),
        "float32 gaussian": (fine_tuned, base),
        "scaled rows": (fine_tuned * rows, base * rows),
        "sorted": (np.sort(fine_tuned), np.zeros(N, np.float32)),
        "mostly unchanged": (np.where(rng.random(N) < 0.3, fine_tuned, base), base),
        "all equal": (np.full(N, 0.5, np.float32), np.zeros(N, np.float32)),
        "a few huge": (spiky, np.zeros(N, np.float32)),
        "nan": (with_nan, base),
    }


def _widened(values: np.ndarray) -> torch.Tensor:
    if values.dtype == np.uint16:
        return torch.from_numpy((values.astype(np.uint32) << 16).view(np.float32))
    return torch.from_numpy(values)


def _kept(found: tuple[int, int], model: np.ndarray, base: np.ndarray) -> np.ndarray:
    threshold, cutoff = found
    bits: np.ndarray = (_widened(model) - _widened(base)).abs().numpy().view(np.uint32)
    kept: np.ndarray = (bits > threshold) | ((bits == threshold) & (np.arange(bits.size) < cutoff))
    return kept


@pytest.mark.parametrize("step", [N, 65_536, 4099])
@pytest.mark.parametrize("case", list(_cases()))
def test_selection_keeps_the_exact_top_k(case: str, step: int) -> None:
    """`step` ≥ n holds the tensor (sampled); smaller steps read it a chunk at a time."""
    model, base = _cases()[case]
    selection = Selection(check_cancel=lambda: None)
    magnitude = (_widened(model) - _widened(base)).abs()
    for density in (1e-4, 0.1, 0.5, 0.9, 1 - 1e-5):
        k = kept_count(density, N)
        found = selection.select(N, k, step, lambda s, c: (model[s:][:c], base[s:][:c]))
        kept = _kept(found, model, base)
        assert int(kept.sum()) == k, (case, density)
        np.testing.assert_array_equal(kept, top_k_mask(magnitude, density).numpy())


def _sampled(case: str, density: float) -> Any:
    """What one sampled pass finds (None: it handed over to the radix select)."""
    model, base = _cases()[case]
    k = kept_count(density, N)
    low, high = _sample_bounds(model, base, k)
    inputs = lambda s, c: (model[s:][:c], base[s:][:c])  # noqa: E731
    return Selection(check_cancel=lambda: None)._between(N, k, N, inputs, low, high, N // 8)


def test_the_sample_bounds_ordinary_deltas_in_one_pass() -> None:
    for case in ("bf16 fine-tune", "float32 gaussian", "scaled rows", "sorted"):
        for density in (0.1, 0.5, 0.9):
            assert _sampled(case, density) is not None, (case, density)


def test_many_equal_deltas_go_to_the_radix_select() -> None:
    """All |δ| equal: every element lies between the bounds, too many to collect."""
    assert _sampled("all equal", 0.5) is None


def _bit_patterns() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    uniform = rng.integers(0, 2**32, 60_000, dtype=np.uint64).astype(np.uint32)
    gaussian = np.abs(rng.standard_normal(50_000)).astype(np.float32)
    return {
        "one": np.array([7], np.uint32),
        "all equal": np.full(1000, 0xFFFFFFFF, np.uint32),  # the bound above NaN's patterns
        "five values": rng.integers(0, 5, 50_000).astype(np.uint32) + np.uint32(0x3F000000),
        "uniform": uniform,
        # a wide range of few values: every round narrows to one bin of many entries
        "wide and coarse": uniform >> np.uint32(20) << np.uint32(20),
        "gaussian |x|": gaussian.view(np.uint32),
    }


@pytest.mark.parametrize("case", list(_bit_patterns()))
def test_kth_largest_equals_a_sort(case: str) -> None:
    values = _bit_patterns()[case]
    ordered = np.sort(values)
    for rank in sorted({1, 2, values.size // 3, values.size // 2, values.size - 1, values.size}):
        if 1 <= rank <= values.size:
            assert _kth_largest(values, rank) == ordered[values.size - rank], rank
