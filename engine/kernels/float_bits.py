"""float32 to and from the 16-bit floats, one element at a time, for compiled kernels.

BF16 and F16 arrive and leave as their uint16 bit patterns (numba has no 16-bit float type).
Widening is exact. Narrowing rounds to nearest, ties to even, as torch and numpy do; a NaN
becomes BF16's canonical quiet NaN (0x7FC0, as torch writes it), or an F16 quiet NaN keeping
its sign and the top of its payload (as the x86 conversion instruction torch uses does). Every
step is integer or float arithmetic and selects, no branches, so loops over them vectorise.

`fma` is a fused multiply-add (one rounding), the operation torch's addcmul_ performs on
CPUs with FMA, which mergekit-compatible weighted sums must match. Elsewhere, numba does not
let LLVM contract a multiply and an add into one (no fast-math flags): `a * b + c` rounds twice,
as torch's separate mul_ and add_ do.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic, overload
from numba.np import linalg


def _skip_blas_probe() -> None:
    """numba's CPU target, loaded by the first compiled call of a process, imports scipy.linalg
    only to learn whether its np.cov and np.corrcoef may call BLAS: 0.2 CPU-seconds, twice
    that in wall time, and OpenBLAS's threads started, in every merge. Nothing here uses them:
    that module is loaded first, told there is no BLAS (it then computes those in loops)."""
    if "numba.np.arraymath" in sys.modules:
        return
    probe = linalg.ensure_blas

    def no_blas() -> None:
        raise ImportError("BLAS not probed: no compiled kernel here uses it")

    linalg.ensure_blas = no_blas
    try:
        from numba.np import arraymath  # numba: loaded here, its BLAS probe stubbed out
    finally:
        linalg.ensure_blas = probe
    arraymath.ensure_blas = probe  # type: ignore[attr-defined]


_skip_blas_probe()
_u32 = np.uint32
_helper = numba.njit(cache=True)  # called by the kernels; LLVM inlines it there

BF16_NAN = 0x7FC0


@intrinsic
def _fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
    """a·b + c rounded once (llvm.fma: the FMA instruction, or libm's fmaf without one)."""
    signature = types.float32(types.float32, types.float32, types.float32)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.fma(*args)

    return signature, codegen


fma = cast(Callable[[Any, Any, Any], Any], _fma)  # as compiled code calls it


@_helper
def from_bf16(bits: Any) -> Any:
    """BF16 is the upper half of a float32."""
    return _u32(_u32(bits) << _u32(16)).view(np.float32)


@_helper
def as_float32(value: Any) -> Any:
    """BF16 bits (a uint16) widened, a float as float32: one kernel serves both dtypes."""
    return np.float32(as_number(value))


def as_number(value: Any) -> Any:
    """BF16 bits (a uint16) widened, a float (float32 or float64) as it is."""
    raise NotImplementedError  # only called from compiled code


@overload(as_number, inline="always")
def _as_number(value: Any) -> Any:
    if isinstance(value, types.Integer):

        def widen(value: Any) -> Any:
            return from_bf16(value)

        return widen

    def as_is(value: Any) -> Any:
        return value

    return as_is


@_helper
def from_f16(bits: Any) -> Any:
    """Exact: normal halves by moving the exponent into float32's range (a multiplication by
    2^-112 rebiases it, and keeps infinities and NaNs), subnormals by subtracting 0.5 from a
    float32 whose low mantissa bits are the half's."""
    shifted = _u32(_u32(bits) << _u32(16))
    sign = _u32(shifted & _u32(0x80000000))
    doubled = _u32(shifted + shifted)  # the sign shifted out
    normal = np.float32(
        _u32((doubled >> _u32(4)) + _u32(0xE0 << 23)).view(np.float32) * np.float32(2.0**-112)
    )
    subnormal = np.float32(
        _u32((doubled >> _u32(17)) | _u32(126 << 23)).view(np.float32) - np.float32(0.5)
    )
    magnitude = subnormal.view(np.uint32) if doubled < _u32(1 << 27) else normal.view(np.uint32)
    return _u32(sign | _u32(magnitude)).view(np.float32)


@_helper
def to_bf16(value: Any) -> Any:
    bits = np.float32(value).view(np.uint32)
    half = _u32(_u32((bits >> _u32(16)) & _u32(1)) + _u32(0x7FFF))  # ties to even
    rounded = np.uint16(_u32(bits + half) >> _u32(16))
    return rounded if value == value else np.uint16(BF16_NAN)


def store(out: Any, j: int, value: Any) -> None:
    """out[j] = value, rounded to BF16 bits (to_bf16) where `out` holds them (a uint16
    array), as is into a float32 one: one kernel serves both dtypes."""
    raise NotImplementedError  # only called from compiled code


@overload(store, inline="always")
def _store(out: Any, j: Any, value: Any) -> Any:
    if isinstance(out.dtype, types.Integer):

        def narrow(out: Any, j: Any, value: Any) -> Any:
            out[j] = to_bf16(value)

        return narrow

    def as_is(out: Any, j: Any, value: Any) -> Any:
        out[j] = value

    return as_is


@_helper
def to_f16(value: Any) -> Any:
    """Normal results: rebias, round at bit 13 to nearest-even, shift. Subnormal ones: adding
    0.5 puts the float32's last bit at 2^-24, the half's subnormal step, so the addition
    itself rounds (to nearest-even) and the low bits are the half's. From 65520 up: infinity."""
    bits = np.float32(value).view(np.uint32)
    sign = _u32((bits >> _u32(16)) & _u32(0x8000))
    magnitude = _u32(bits & _u32(0x7FFFFFFF))
    rebiased = _u32(magnitude - _u32(0x38000000))
    normal = _u32(_u32(rebiased + _u32(0xFFF) + ((rebiased >> _u32(13)) & _u32(1))) >> _u32(13))
    summed = np.float32(magnitude.view(np.float32) + np.float32(0.5))
    subnormal = _u32(_u32(summed.view(np.uint32)) - _u32(0x3F000000))
    nan = _u32(_u32(0x7E00) | ((magnitude >> _u32(13)) & _u32(0x3FF)))
    half = subnormal if magnitude < _u32(0x38800000) else normal
    half = _u32(0x7C00) if magnitude >= _u32(0x477FF000) else half
    half = nan if magnitude > _u32(0x7F800000) else half
    return np.uint16(_u32(sign | half))
