"""The compiled kernels' threads: a slice of the elements each, on every core.

numba's `parallel=True` would need a threading layer that is safe both when merges run on
several threads at once (the service's executor) and after a fork (a prefork worker): its
default (workqueue) aborts on concurrent use and GNU OpenMP's is not fork-safe. Plain threads
calling kernels that release the GIL are both, at the cost of a task submission per slice.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

THREADS = max(1, min(4, os.cpu_count() or 1))
MIN_SPLIT = 1 << 16  # below this many elements one thread does it all


def parallel(kernel: Any, n: int, *args: Any, split: bool = False) -> None:
    """Run `kernel(*args, lo, hi)` over [0, n) in up to THREADS slices (the kernels release
    the GIL). With `split`, the last argument has a row per slice (a histogram each)."""
    slices = THREADS if n >= MIN_SPLIT else 1
    bounds = [n * s // slices for s in range(slices + 1)]
    side_by_side(
        [
            functools.partial(
                kernel, *args[:-1], args[-1][s] if split else args[-1], bounds[s], bounds[s + 1]
            )
            for s in range(slices)
        ]
    )


def side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run the calls on the caller's thread and the pool's, all at once."""
    futures = [_pool().submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


def _pool() -> ThreadPoolExecutor:
    """Helper threads for the slices after the first (the caller's thread runs that one)."""
    return _pool_of(os.getpid())


@functools.cache
def _pool_of(pid: int) -> ThreadPoolExecutor:
    """One per process: a forked child (a prefork worker) has none of its parent's threads."""
    return ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="kernels")
