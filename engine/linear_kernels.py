"""Linear ops on the CPU in numpy: the same arithmetic as kernels.Kernels, without torch.

A layer swap or a soup computes only weighted sums (its averaged embeddings and lm_head, its
souped layers), which numpy does as fast as torch here; torch costs ~3 CPU-seconds to import,
a third of a 1.7B layer swap on 2 cores. So plans whose computed tensors are all linear over
BF16/F16/F32 run here, and only TIES, float64/float8 and CUDA plans load torch.

The arithmetic is torch's, bit for bit: each term widened to float32 exactly, multiplied by
its coefficient as a float32, summed in term order, rounded once to the output dtype
(round-to-nearest-even). Only NaN payloads may differ: every NaN is written as the canonical
quiet NaN.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator

import numpy as np
import numpy.typing as npt

from engine.memory import keep_freed_memory
from engine.plan import Plan, TensorPlan

SUPPORTED_DTYPES = frozenset({"BF16", "F16", "F32"})
_NUMPY_DTYPES: dict[str, np.dtype[np.generic]] = {
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
}
_BF16_NAN = 0x7FC0
# Typed constants keep numpy's integer ops in uint32 (a Python int would promote to int64).
_SIXTEEN, _ONE, _HALF_ULP = np.uint32(16), np.uint32(1), np.uint32(0x7FFF)

Floats = npt.NDArray[np.float32]


def handles(plan: Plan, device: str) -> bool:
    """Whether this module can compute every tensor the plan does not copy."""
    if device != "cpu" or plan.ties is not None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op != "linear" or tensor.dtype not in SUPPORTED_DTYPES:
            return False
        for term in tensor.terms:
            if (
                plan.checkpoints[term.source].tensors[tensor.read_name].dtype
                not in SUPPORTED_DTYPES
            ):
                return False
    return True


class LinearKernels:
    def __init__(self, plan: Plan, *, chunk_elements: int) -> None:
        self.plan = plan
        keep_freed_memory()  # chunk buffers are reused, not page-faulted in again
        # Quarter chunks keep the float32 temporaries in the CPU's cache (as in kernels.py).
        self.compute_elements = max(1, chunk_elements // 4)
        self._widened = np.zeros(self.compute_elements, np.float32)

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        numel = math.prod(tensor.shape)
        step = self.compute_elements
        acc = np.empty(min(step, numel), np.float32)
        for start in range(0, numel, step):
            count = min(step, numel - start)
            total = acc[:count]
            for i, term in enumerate(tensor.terms):
                x = self._read_widened(term.source, tensor.read_name, start, count)
                if i == 0:
                    np.multiply(x, np.float32(term.coefficient), out=total)
                elif term.coefficient == 1.0:
                    total += x
                else:
                    x *= np.float32(term.coefficient)
                    total += x
            yield narrow(total, tensor.dtype).view(np.uint8).data

    def _read_widened(self, source: int, name: str, start: int, count: int) -> Floats:
        """`count` elements from `start` as float32 (exact: every supported dtype fits)."""
        checkpoint = self.plan.checkpoints[source]
        info = checkpoint.tensors[name]
        raw = np.empty(count * info.itemsize, np.uint8)
        self.plan.read_into(source, name, raw.data, start * info.itemsize)
        if info.dtype == "F32":
            return raw.view(np.float32)
        widened = self._widened[:count]
        if info.dtype == "F16":
            widened[:] = raw.view(np.float16)
        else:  # BF16 is the upper half of a float32
            bits = widened.view(np.uint32)
            bits[:] = raw.view(np.uint16)
            bits <<= _SIXTEEN
        return widened


def narrow(values: Floats, dtype: str) -> npt.NDArray[np.generic]:
    """float32 values rounded to `dtype` (a new array; `values` is clobbered for BF16)."""
    if dtype != "BF16":
        return values.astype(_NUMPY_DTYPES[dtype])
    nans = np.isnan(values)
    bits = values.view(np.uint32)
    lowest_kept = bits >> _SIXTEEN
    lowest_kept &= _ONE
    lowest_kept += _HALF_ULP  # round to nearest, ties to even
    bits += lowest_kept
    bits >>= _SIXTEEN
    out = bits.astype(np.uint16)
    if nans.any():
        out[nans] = _BF16_NAN
    return out
