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


def parallel(
    kernel: Any, n: int, *args: Any, per_slice: Any = None, minimum: int = MIN_SPLIT
) -> None:
    """Run `kernel(*args, [per_slice[s],] lo, hi)` over [0, n) in up to THREADS slices (the
    kernels release the GIL); `per_slice` gives each slice its own row (a histogram each)."""
    over(kernel, 0, n, *args, slices=min(THREADS, n) if n >= minimum else 1, per_slice=per_slice)


def over(kernel: Any, lo: int, hi: int, *args: Any, slices: int, per_slice: Any = None) -> None:
    """Run `kernel(*args, [per_slice[s],] lo_s, hi_s)` over [lo, hi) cut into `slices` slices,
    all at once."""
    bounds = [lo + (hi - lo) * s // slices for s in range(slices + 1)]
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
    return ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="kernels")
