"""torch's thread count for a reduction whose bits mergekit's depend on.

A sum over more elements than torch's grain (32768; BLAS's dot from 8192) is split among its
threads, and its order, so its last bits, follow their count. mergekit runs with the process's
default count; the kernels lower it while they compute (torch_kernels.py), so the reductions
that must equal mergekit's run with the default again.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def using_threads(count: int) -> Iterator[None]:
    """torch on `count` threads inside (0: as it is)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count or previous)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
