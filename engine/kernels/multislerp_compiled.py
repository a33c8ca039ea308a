"""multislerp's elementwise steps over a piece of a tensor, compiled: the torch operations of
MultiSlerp.merge_whole fused into one loop per pass, the same bits.

Each torch operation on bfloat16 tensors computes in float32 and rounds once to bfloat16, so
each step here is that float32 operation followed by that rounding (`narrow`); float32 and
float64 arithmetic round in their own dtype. A sum over the models (torch's `sum(0)`) starts
from +0 and adds them in order in float32 (float64 for float64), rounded once.

The inputs arrive as one array of rows, the models then (`with_base`) the base: bfloat16 as
their bits (uint16), float32 and float64 as they are. Each pass works a block of entries at a
time, one step over the whole block before the next (so that numba vectorises each step).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from engine.kernels.float_bits import as_number, from_bf16, to_bf16

Array = Any  # a numpy array, as compiled code takes it
_jit = numba.njit(nogil=True, cache=True, error_model="numpy")
_helper = numba.njit(cache=True)  # called by the kernels; LLVM inlines it there


@_helper
def _r(value: Any, narrow: bool) -> Any:
    """value rounded to the arithmetic's dtype (bfloat16 where narrow)."""
    return from_bf16(to_bf16(value)) if narrow else value


BLOCK = 2048  # entries whose steps are taken together, in scratch rows that stay in cache


@_helper
def _units(
    xs: Array, lo: int, hi: int, with_base: bool, divisors: Array, narrow: bool, units: Array
) -> None:
    """units[i, :hi-lo] = model i's vector over [lo, hi) divided by divisors[i]."""
    # rows sliced and indexed from 0: numba then drops negative-index checks and vectorises
    base = xs[xs.shape[0] - 1, lo:hi]
    for i in range(units.shape[0]):
        d, src, dst = divisors[i], xs[i, lo:hi], units[i]
        if with_base:
            for j in range(hi - lo):
                dst[j] = _r(_r(as_number(src[j]) - as_number(base[j]), narrow) / d, narrow)
        else:
            for j in range(hi - lo):
                dst[j] = _r(as_number(src[j]) / d, narrow)


@_helper
def _mean(
    units: Array, n: int, w: Array, narrow: bool, zero: Any, mean_norm: Any, out: Array
) -> None:
    """out[:n] = Σᵢ wᵢ·uᵢ (from +0, in order, each product rounded, the sum rounded once),
    divided by mean_norm unless it is 0 (then as it is)."""
    for j in range(n):
        out[j] = zero
    for i in range(units.shape[0]):
        wi, row = w[i], units[i]
        for j in range(n):
            out[j] += _r(row[j] * wi, narrow)
    for j in range(n):
        out[j] = _r(out[j], narrow)
    if mean_norm != zero:
        for j in range(n):
            out[j] = _r(out[j] / mean_norm, narrow)


@_helper
def _tangent(
    units: Array, n: int, mean: Array, dots: Array, w: Array, narrow: bool, zero: Any,
    out: Array,
) -> None:  # fmt: skip
    """out[:n] = Σᵢ (uᵢ − dotsᵢ·mean)·wᵢ, each step rounded, the sum as _mean's."""
    for j in range(n):
        out[j] = zero
    for i in range(units.shape[0]):
        di, wi, row = dots[i], w[i], units[i]
        for j in range(n):
            away = _r(row[j] - _r(di * mean[j], narrow), narrow)
            out[j] += _r(away * wi, narrow)
    for j in range(n):
        out[j] = _r(out[j], narrow)


@_jit
def vectors(xs: Array, with_base: bool, narrow: bool, out: Array) -> None:
    """out[i] = model i's vector."""
    base = xs[xs.shape[0] - 1]
    for i in range(out.shape[0]):
        src, dst = xs[i], out[i]
        if with_base:
            for j in range(len(dst)):
                dst[j] = _r(as_number(src[j]) - as_number(base[j]), narrow)
        else:
            for j in range(len(dst)):
                dst[j] = as_number(src[j])


@_jit
def means(
    xs: Array, with_base: bool, divisors: Array, w: Array, mean_norm: Any, narrow: bool,
    zero: Any, out: Array,
) -> None:  # fmt: skip
    """out = the weighted mean of the unit vectors (divided by mean_norm, unless 0)."""
    units = np.empty((len(divisors), BLOCK), out.dtype)
    for lo in range(0, len(out), BLOCK):
        hi = min(lo + BLOCK, len(out))
        _units(xs, lo, hi, with_base, divisors, narrow, units)
        _mean(units, hi - lo, w, narrow, zero, mean_norm, out[lo:hi])


@_jit
def dot_terms(
    xs: Array, with_base: bool, divisors: Array, w: Array, mean_norm: Any, narrow: bool,
    zero: Any, out: Array,
) -> None:  # fmt: skip
    """out[i] = uᵢ·m, m the weighted mean of the unit vectors divided by mean_norm."""
    units = np.empty((len(divisors), BLOCK), out.dtype)
    mean = np.empty(BLOCK, out.dtype)
    for lo in range(0, out.shape[1], BLOCK):
        hi = min(lo + BLOCK, out.shape[1])
        _units(xs, lo, hi, with_base, divisors, narrow, units)
        _mean(units, hi - lo, w, narrow, zero, mean_norm, mean)
        for i in range(units.shape[0]):
            row, dst = units[i], out[i, lo:hi]
            for j in range(hi - lo):
                dst[j] = _r(row[j] * mean[j], narrow)


@_jit
def tangents(
    xs: Array, with_base: bool, divisors: Array, w: Array, mean_norm: Any, dots: Array,
    narrow: bool, zero: Any, out: Array,
) -> None:  # fmt: skip
    """out = the weighted mean of the unit vectors' projections on the tangent space at m."""
    units = np.empty((len(divisors), BLOCK), out.dtype)
    mean = np.empty(BLOCK, out.dtype)
    for lo in range(0, len(out), BLOCK):
        hi = min(lo + BLOCK, len(out))
        _units(xs, lo, hi, with_base, divisors, narrow, units)
        _mean(units, hi - lo, w, narrow, zero, mean_norm, mean)
        _tangent(units, hi - lo, mean, dots, w, narrow, zero, out[lo:hi])


@_jit
def outputs(
    xs: Array, with_base: bool, divisors: Array, w: Array, mean_norm: Any, dots: Array,
    cos: Any, ratio: Any, scale: Any, narrow: bool, zero: Any, out: Array,
) -> None:  # fmt: skip
    """out = (m·cos + tangent·ratio)·scale (+ the base), each step rounded."""
    units = np.empty((len(divisors), BLOCK), out.dtype)
    mean = np.empty(BLOCK, out.dtype)
    tangent = np.empty(BLOCK, out.dtype)
    for lo in range(0, len(out), BLOCK):
        hi = min(lo + BLOCK, len(out))
        _units(xs, lo, hi, with_base, divisors, narrow, units)
        _mean(units, hi - lo, w, narrow, zero, mean_norm, mean)
        _tangent(units, hi - lo, mean, dots, w, narrow, zero, tangent)
        dst = out[lo:hi]
        for j in range(hi - lo):
            moved = _r(_r(mean[j] * cos, narrow) + _r(tangent[j] * ratio, narrow), narrow)
            dst[j] = _r(moved * scale, narrow)
        if with_base:
            base = xs[xs.shape[0] - 1, lo:hi]
            for j in range(hi - lo):
                dst[j] = _r(dst[j] + as_number(base[j]), narrow)
