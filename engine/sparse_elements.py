"""What the compiled sparse kernels share: element access and threads.

Inputs arrive as their raw elements: BF16 as its uint16 bit pattern (the upper half of a
float32), F32 as itself (F16 is widened by numpy first); outputs leave as float32 or BF16 bits,
rounded to nearest-even with NaN as the canonical quiet NaN (as torch writes it). The kernels
release the GIL and run on plain threads, a slice of the elements each: numba's own threading
layers are not safe both under concurrent merges (the service's executor) and after a fork (a
prefork worker). ties_kernels.py has the same helpers for TIES.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba import types
from numba.extending import overload

THREADS = max(1, min(4, os.cpu_count() or 1))
MIN_SPLIT = 1 << 16  # below this many elements one thread does it all

Array = npt.NDArray[Any]


def as_float32(value: Any) -> Any:
    raise NotImplementedError  # only called from compiled code


@overload(as_float32, inline="always")
def _as_float32_impl(value: Any) -> Any:
    """BF16 arrives as its uint16 bit pattern (the upper half of a float32), F32 as itself
    (F16 is widened by numpy first)."""
    if isinstance(value, types.Integer):

        def from_bf16_bits(value: Any) -> Any:
            return np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)

        return from_bf16_bits

    def as_is(value: Any) -> Any:
        return np.float32(value)

    return as_is


def store(out: Any, j: int, value: Any) -> None:
    raise NotImplementedError  # only called from compiled code


@overload(store, inline="always")
def _store_impl(out: Any, j: Any, value: Any) -> Any:
    """Into a BF16 output (uint16 bits): round to nearest-even, NaN as the canonical quiet NaN;
    into a float32 one: as is."""
    if isinstance(out.dtype, types.Integer):

        def to_bf16(out: Any, j: Any, value: Any) -> Any:
            bits = np.float32(value).view(np.uint32)
            half = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
            rounded = np.uint16(np.uint32(bits + half) >> np.uint32(16))
            out[j] = rounded if value == value else np.uint16(0x7FC0)

        return to_bf16

    def as_is(out: Any, j: Any, value: Any) -> Any:
        out[j] = value

    return as_is


@numba.njit(inline="always", cache=True)
def abs_delta_bits(model: Any, base: Any) -> Any:
    """|model − base| in float32, as its bit pattern (ordered like the value)."""
    delta = np.float32(as_float32(model) - as_float32(base))
    return np.float32(abs(delta)).view(np.uint32)


# -- threads ------------------------------------------------------------------------------------
def split(
    kernel: Any, n: int, *args: Any, per_slice: Array | None = None, minimum: int = MIN_SPLIT
) -> None:
    """Run `kernel(*args, [per_slice[s],] lo, hi)` over [0, n) in up to THREADS slices (the
    kernels release the GIL); `per_slice` gives each slice its own row (a histogram each)."""
    slices = min(THREADS, n) if n >= minimum else 1
    bounds = [n * s // slices for s in range(slices + 1)]
    own = [(per_slice[s],) if per_slice is not None else () for s in range(slices)]
    side_by_side(
        [functools.partial(kernel, *args, *own[s], bounds[s], bounds[s + 1]) for s in range(slices)]
    )


def side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run the calls on the caller's thread and the pool's, all at once."""
    futures = [_pool_of(os.getpid()).submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


@functools.cache
def _pool_of(pid: int) -> ThreadPoolExecutor:
    """One per process: a forked child (a prefork worker) has none of its parent's threads."""
    return ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="sparse")
