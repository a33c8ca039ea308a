"""mergekit's task arithmetic in bfloat16 or float16 on the CPU, without torch.

narrow.py's compiled kernel computes it as mergekit's torch steps do, bit for bit (narrow_torch's
NarrowTaskVectors runs the same kernel with torch as its glue). Here the glue is numpy: each
weight rounded to the dtype as torch rounds a Python float (to float32, then to the dtype), and
their sum, the divisor of `normalize`, made as torch sums a column of fewer than MAX_TERMS (in
float32, in its kernel's order, rounded once). A plan whose every computed tensor is such a tensor,
its inputs and output stored in the dtype it computes in, then never imports torch: a second
and some 200 MB of a merge that takes a few seconds.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from engine.io.memory import keep_freed_memory
from engine.kernels.input_rows import InputRows
from engine.kernels.parallel import parallel
from engine.plan.arithmetic import NARROW, input_dtypes, tensor_arithmetic
from engine.plan.model import Plan, TensorPlan

MAX_TERMS = 16  # torch sums a column this long or longer in vector lanes, in another order
ZERO_DIVISOR = 1e-8  # mergekit's: a sum of weights closer to zero divides by 1


def handles(plan: Plan, device: str) -> bool:
    """Whether every tensor the plan does not copy is mergekit's narrow task arithmetic, read
    and written in the dtype it computes in."""
    if device != "cpu" or plan.ties is None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        arithmetic = tensor_arithmetic(plan, tensor)
        if (
            tensor.op != "task_arithmetic"
            or len(tensor.terms) >= MAX_TERMS
            or arithmetic.compute not in NARROW
            or {tensor.dtype, *input_dtypes(plan, tensor)} != {arithmetic.compute}
        ):
            return False
    return True


class NarrowArithmeticKernels:
    def __init__(self, plan: Plan, *, chunk_elements: int) -> None:
        assert plan.ties is not None  # handles() checked it
        self.plan, self.settings = plan, plan.ties
        keep_freed_memory()  # output chunks are reused memory, not page-faulted in again
        # quarter chunks, as the torch kernels compute: the running sum stays in the cache
        self.step = max(1, chunk_elements // 4)
        self._rows = InputRows(plan, keep=True, bits=True)

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a quarter chunk at a time, in order."""
        f16 = tensor.dtype == "F16"
        column = np.array([rounded(t.coefficient, f16) for t in tensor.terms], np.float32)
        divisor = summed(column, f16)
        if abs(divisor) < rounded(ZERO_DIVISOR, f16):  # compared in the dtype, as torch does
            divisor = 1.0
        lambda_ = self.settings.scale(tensor)
        sources = [self.settings.base, *(term.source for term in tensor.terms)]
        numel = math.prod(tensor.shape)
        # numba: the compiled kernel, loaded only once handles() has admitted the plan
        from engine.kernels import narrow

        for start in range(0, numel, self.step):
            count = min(self.step, numel - start)
            rows = self._rows.read(tensor, sources, start, count)  # the base first
            out = np.empty(count, np.uint16)  # the writer keeps it
            parallel(narrow.task_arithmetic, count, rows[0], rows[1:], column, f16,
                     self.settings.normalize, divisor, lambda_ != 1, lambda_, out)  # fmt: skip
            yield out.view(np.uint8).data


def rounded(value: float, f16: bool) -> float:
    """A Python float as torch stores it in a bf16 or fp16 tensor: rounded to float32, then
    to the dtype (to nearest, ties to even)."""
    # numba: the compiled kernels' own rounding to bf16
    from engine.kernels.float_bits import from_bf16, to_bf16

    with np.errstate(over="ignore"):  # beyond the dtype: infinity, as torch rounds it
        if f16:
            return float(np.float16(np.float32(value)))
        return float(from_bf16(to_bf16(np.float32(value))))


def summed(column: Any, f16: bool) -> float:
    """torch's sum of a column of fewer than MAX_TERMS weights of the dtype: widened, summed in
    float32 in its kernel's order (linear.row_sum), rounded once to the dtype."""
    # numba: linear.py's module, loaded with the kernel once handles() has admitted the plan
    from engine.kernels.linear import row_sum

    with np.errstate(over="ignore", invalid="ignore"):  # infinities, as torch sums them
        total = row_sum(np.asarray(column, np.float32))
    return rounded(float(total), f16)
