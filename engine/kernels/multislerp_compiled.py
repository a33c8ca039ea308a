"""multislerp's elementwise steps over a piece of a tensor, compiled: the torch operations of
MultiSlerp.merge_whole fused into one loop per step, the same bits.

Each torch operation on bfloat16 tensors computes in float32 and rounds once to bfloat16, so
each step here is that float32 operation followed by that rounding (`narrow`); float32 and
float64 arithmetic round in their own dtype. A sum over the models (torch's `sum(0)`) starts
from +0 and adds them in order in float32 (float64 for float64), rounded once. Values arrive
widened (bfloat16 as float32, exactly) and leave in the arithmetic's working dtype.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

from engine.kernels.float_bits import from_bf16, to_bf16

Array = Any  # a numpy array, as compiled code takes it
_jit = numba.njit(nogil=True, cache=True, error_model="numpy")
_inline = numba.njit(inline="always", cache=True)


@_inline
def _r(value: Any, narrow: bool) -> Any:
    """value rounded to the arithmetic's dtype (bfloat16 where narrow)."""
    return from_bf16(to_bf16(value)) if narrow else value


@_jit
def difference(models: Array, base: Array, narrow: bool, out: Array) -> None:
    """out[i] = models[i] − base."""
    for i in range(models.shape[0]):
        for j in range(models.shape[1]):
            out[i, j] = _r(models[i, j] - base[j], narrow)


@_jit
def added(values: Array, base: Array, narrow: bool) -> None:
    """values += base."""
    for j in range(values.shape[0]):
        values[j] = _r(values[j] + base[j], narrow)


@_jit
def units(vectors: Array, divisors: Array, narrow: bool, out: Array) -> None:
    """out[i] = vectors[i] / divisors[i]."""
    for i in range(vectors.shape[0]):
        d = divisors[i]
        for j in range(vectors.shape[1]):
            out[i, j] = _r(vectors[i, j] / d, narrow)


@_jit
def weighted_mean(units: Array, w: Array, narrow: bool, zero: Any, out: Array) -> None:
    """out = Σᵢ units[i]·w[i] (torch's (units * w).sum(0)), each product rounded."""
    for j in range(units.shape[1]):
        total = zero
        for i in range(units.shape[0]):
            total += _r(units[i, j] * w[i], narrow)
        out[j] = _r(total, narrow)


@_jit
def scaled(values: Array, divisor: Any, narrow: bool, out: Array) -> None:
    """out = values / divisor."""
    for j in range(values.shape[0]):
        out[j] = _r(values[j] / divisor, narrow)


@_jit
def products(units: Array, mean: Array, narrow: bool, out: Array) -> None:
    """out[i] = units[i]·mean."""
    for i in range(units.shape[0]):
        for j in range(units.shape[1]):
            out[i, j] = _r(units[i, j] * mean[j], narrow)


@_jit
def tangent(
    units: Array, mean: Array, dots: Array, w: Array, narrow: bool, zero: Any, out: Array
) -> None:
    """out = Σᵢ (units[i] − dots[i]·mean)·w[i] (torch's sum(0)), each step rounded."""
    for j in range(units.shape[1]):
        total = zero
        m = mean[j]
        for i in range(units.shape[0]):
            away = _r(units[i, j] - _r(dots[i] * m, narrow), narrow)
            total += _r(away * w[i], narrow)
        out[j] = _r(total, narrow)


@_jit
def mapped(
    mean: Array, tangent: Array, cos: Any, ratio: Any, scale: Any, narrow: bool, out: Array
) -> None:
    """out = (mean·cos + tangent·ratio)·scale, each step rounded."""
    for j in range(mean.shape[0]):
        moved = _r(_r(mean[j] * cos, narrow) + _r(tangent[j] * ratio, narrow), narrow)
        out[j] = _r(moved * scale, narrow)


def working_dtype(narrow: bool, wide: bool) -> Any:
    """numpy's dtype for values of the arithmetic: float64 for float64, else float32."""
    return np.float64 if wide and not narrow else np.float32
