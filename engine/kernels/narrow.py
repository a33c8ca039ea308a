"""Task arithmetic and TIES in mergekit's bf16 or fp16 arithmetic, compiled with numba: the
steps of narrow_torch.combine (and TIES's trimming before it) fused into one pass per element,
the same bits in a fraction of torch's time.

Each torch operation on bf16 or fp16 tensors computes in float32 and rounds once to the dtype
(float_bits' to_bf16 and to_f16 round as torch does); torch sums a bf16 or fp16 tensor over its
models in float32, from +0 in model order, and rounds the sum once. So each step here is that
float32 operation followed by that rounding. The inputs arrive and the output leaves as 16-bit
patterns (uint16).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from engine.kernels.float_bits import from_bf16, from_f16, to_bf16, to_f16

Array = Any  # a numpy array, as compiled code takes it
_helper = numba.njit(cache=True)  # called by the kernels; LLVM inlines it there
_jit = numba.njit(nogil=True, cache=True, error_model="numpy")
# How a term's delta is trimmed: not at all, by a threshold with a quota of tied entries kept
# in flat order (top_k.TopK), or by a mask (narrow_torch.sorted_mask).
UNTRIMMED, THRESHOLD, MASK = 0, 1, 2


@_helper
def _widen(bits: Any, f16: bool) -> Any:
    return from_f16(bits) if f16 else from_bf16(bits)


@_helper
def _narrow(value: Any, f16: bool) -> Any:
    return to_f16(value) if f16 else to_bf16(value)


@_helper
def _rounded(value: Any, f16: bool) -> Any:
    """float32 `value` rounded to the narrow dtype, as a float32."""
    return _widen(_narrow(value, f16), f16)


@_helper
def _weighted_row(base: Array, row: Array, weight: Any, f16: bool, out: Array) -> None:
    """out[q] = the rounded delta of `row` at q, weighted and rounded (arrays of one length)."""
    for q in range(len(out)):
        delta = _rounded(_widen(row[q], f16) - _widen(base[q], f16), f16)
        out[q] = _rounded(delta * weight, f16)


@_helper
def _trimmed_row(
    base: Array, row: Array, weight: Any, threshold: Any, quota: int, mask: Array, mode: int,
    f16: bool, out: Array,
) -> int:  # fmt: skip
    """_weighted_row of a delta trimmed first: by `threshold`, the first `quota` entries equal
    to it kept too (in flat order), or by `mask`; a dropped δ is δ·0 (±0, as mergekit's mask
    makes it). Returns the quota left."""
    for q in range(len(out)):
        delta = _rounded(_widen(row[q], f16) - _widen(base[q], f16), f16)
        if mode == MASK:
            kept = mask[q]
        else:
            magnitude = abs(delta)
            kept = magnitude > threshold
            if quota > 0 and magnitude == threshold:  # a tie at the cut, kept while they last
                kept = True
                quota -= 1
        out[q] = _rounded(delta * np.float32(kept) * weight, f16)
    return quota


@_jit
def task_arithmetic(
    base: Array, terms: Array, weights: Array, f16: bool, normalize: bool, divisor: float,
    scale: bool, lambda_: float, out: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """out = base + λ·Σ wᵢ·δᵢ [÷ `divisor`] over elements [lo, hi), every step rounded to the
    dtype (fp16 with `f16`, else bf16). Term by term, each weighted delta added to the sum as
    it is made, so that each loop vectorises; the loops index views of [lo, hi) from 0 (an
    index that may be negative costs each access a wrap-around select, which kept them scalar:
    a bf16 merge ran five times slower)."""
    base, out = base[lo:hi], out[lo:hi]
    total = np.zeros(hi - lo, np.float32)  # torch's sums start from +0
    for i in range(terms.shape[0]):
        row, weight = terms[i, lo:hi], weights[i]
        for q in range(hi - lo):
            delta = _rounded(_widen(row[q], f16) - _widen(base[q], f16), f16)
            total[q] += _rounded(delta * weight, f16)
    # ÷ 1 and × 1 are exact and leave a rounded value as it is: no branch in the loop
    by = np.float32(divisor) if normalize else np.float32(1.0)
    factor = np.float32(lambda_) if scale else np.float32(1.0)
    for q in range(hi - lo):
        mixed = _rounded(_rounded(_rounded(total[q], f16) / by, f16) * factor, f16)
        out[q] = _narrow(_widen(base[q], f16) + mixed, f16)


@_jit
def ties(
    base: Array, terms: Array, weights: Array, modes: Array, thresholds: Array, quotas: Array,
    masks: Array, f16: bool, normalize: bool, scale: bool, lambda_: float, out: Array,
    lo: int, hi: int,
) -> None:  # fmt: skip
    """out = base + λ·Σ of the weighted, trimmed deltas agreeing with their sum's sign [÷ the
    sum of their weights] over elements [lo, hi), every step rounded to the dtype. `quotas`
    (ties still to keep, per term, in flat order) is updated for the next elements: [lo, hi)
    may be split between threads only once they are spent. Loops index views of [lo, hi) from
    0, as task_arithmetic's."""
    n, zero = terms.shape[0], np.float32(0.0)
    base, out, masks = base[lo:hi], out[lo:hi], masks[:, lo:hi]
    weighted = np.empty((n, hi - lo), np.float32)
    total = np.zeros(hi - lo, np.float32)
    for i in range(n):
        if modes[i] == UNTRIMMED:
            _weighted_row(base, terms[i, lo:hi], weights[i], f16, weighted[i])
        else:
            quotas[i] = _trimmed_row(base, terms[i, lo:hi], weights[i], thresholds[i], quotas[i],
                                     masks[i], modes[i], f16, weighted[i])  # fmt: skip
        total += weighted[i]
    up = np.empty(hi - lo, np.bool_)  # the elected sign: the rounded sum's, 0 counting as +
    for q in range(hi - lo):
        up[q] = _rounded(total[q], f16) >= zero
    mixed, divisor = np.zeros(hi - lo, np.float32), np.zeros(hi - lo, np.float32)
    for i in range(n):  # a delta that disagrees adds δ·0, its weight w·0, as mergekit's mask
        for q in range(hi - lo):
            agree = np.float32((weighted[i, q] > zero) if up[q] else (weighted[i, q] < zero))
            mixed[q] += weighted[i, q] * agree
            divisor[q] += weights[i] * agree
    factor = np.float32(lambda_) if scale else np.float32(1.0)
    one = np.float32(1.0)
    for q in range(hi - lo):  # ÷ 1 and × 1 leave a rounded value as it is: no branches
        by = _rounded(divisor[q], f16)
        by = (one if by == zero else by) if normalize else one
        part = _rounded(_rounded(_rounded(mixed[q], f16) / by, f16) * factor, f16)
        out[q] = _narrow(_widen(base[q], f16) + part, f16)
