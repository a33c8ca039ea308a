"""The inputs' elements of one tensor side by side, as the compiled kernels read them.

The rows of one array, one per source, all of one dtype (the kernels' `handles()` check that
the sources agree): BF16 as its uint16 bit pattern, F16 widened to float32 (or, for kernels
that compute in float16, as its bit pattern too), F32 as is. Each source is read on a thread of
its own, through `Plan.read_into` (so rows are aligned to the output's vocabulary where they
are).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np
import numpy.typing as npt

from engine.kernels.parallel import side_by_side
from engine.plan.model import Plan, TensorPlan

Array = npt.NDArray[Any]
SUPPORTED_DTYPES = frozenset({"BF16", "F16", "F32"})


def readable(plan: Plan, tensor: TensorPlan, sources: Iterable[int]) -> bool:
    """Whether the kernels can read and write this tensor: its output and every source's copy
    of it in one of SUPPORTED_DTYPES, the sources all in the same one."""
    dtypes = {plan.checkpoints[s].tensors[tensor.read_name].dtype for s in sources}
    return tensor.dtype in SUPPORTED_DTYPES and len(dtypes) == 1 and dtypes <= SUPPORTED_DTYPES


class InputRows:
    """Reads a tensor's elements from several sources into the rows of one array. With `keep`,
    the array is one buffer grown and reused from call to call (fresh memory costs a page
    fault per page): each call then overwrites what the previous one returned. With `bits`,
    F16 is read as its uint16 bit pattern, as BF16 is, instead of widened."""

    def __init__(self, plan: Plan, *, keep: bool = False, bits: bool = False) -> None:
        self.plan = plan
        self.keep = keep
        self.bits = bits
        self._buffer = np.empty(0, np.uint8)

    def read(self, tensor: TensorPlan, sources: Sequence[int], start: int, count: int) -> Array:
        """Elements [start, start + count) of the tensor from each source, a row each."""
        first = self.plan.checkpoints[sources[0]].tensors[tensor.read_name]
        as_bits = first.dtype == "BF16" or (self.bits and first.dtype == "F16")
        dtype = np.dtype(np.uint16 if as_bits else np.float32)
        rows = self._rows(dtype, len(sources), count)
        side_by_side(
            [
                partial(self._read, tensor, source, row, start, count)
                for source, row in zip(sources, rows, strict=True)
            ]
        )
        return rows

    def _rows(self, dtype: np.dtype[Any], sources: int, count: int) -> Array:
        if not self.keep:
            return np.empty((sources, count), dtype)
        size = sources * count * dtype.itemsize
        if self._buffer.size < size:
            self._buffer = np.empty(size, np.uint8)
        return self._buffer[:size].view(dtype).reshape(sources, count)

    def _read(self, tensor: TensorPlan, source: int, row: Array, start: int, count: int) -> None:
        info = self.plan.checkpoints[source].tensors[tensor.read_name]
        first_byte = start * info.itemsize
        if info.dtype != "F16" or self.bits:  # the bytes as they are
            self.plan.read_into(source, tensor.read_name, row.view(np.uint8).data, first_byte)
            return
        raw = np.empty(count * info.itemsize, np.uint8)
        self.plan.read_into(source, tensor.read_name, raw.data, first_byte)
        row[:] = raw.view(np.float16)
