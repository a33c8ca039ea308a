"""torch's CPU sum over the rows of a 2-D tensor, reproduced a block of rows at a time.

mergekit pads an aligned embedding with `torch.mean(rows, dim=0)`: for bfloat16 and float16
torch sums in float32, divides by the row count in float32 and rounds once to the dtype; for
float32 and float64 it sums and divides in the dtype. Its CPU sum over the rows of a contiguous
tensor (SumKernel.cpp's multi_row_sum) adds the rows in order into the first of four
accumulators; after every 2^p rows (p = max(4, ceil(log2(rows)) // 4)) each accumulator is
carried into the next, up a level for each multiple of 2^(p·level) reached; at the end the four
are added, first into last. Every column is summed alike, so that order is reproduced here with
four accumulators of one row each, whatever the number of rows.

torch takes that order for the columns it sums in groups of four vector widths (64 float32
columns with AVX-512, 32 with AVX2): every column when the width is a multiple of 64 and the sum
runs on one thread (tensors under 32768 elements, or torch on one thread), or on threads each
given a multiple of 64 columns. A range of columns left over sums its rows in four interleaved
streams instead: there torch's mean, and so mergekit's padding rows, may differ from this in the
last bit (and from one machine to another).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

LEVELS = 4  # the cascade's accumulator levels (also of torch_order's sums over a row)


class RowSum:
    """The sum of `count` rows of `width` elements in `dtype`, fed in order by add()."""

    def __init__(self, count: int, width: int, dtype: Any) -> None:
        self.power = max(4, ceil_log2(count) // LEVELS)
        self.mask = (1 << self.power) - 1
        self.levels = [np.zeros(width, dtype) for _ in range(LEVELS)]
        self.seen = 0

    def add(self, rows: npt.NDArray[Any]) -> None:
        """Add the next rows (a 2-D block, in the accumulators' dtype)."""
        first = self.levels[0]
        for row in rows:
            first += row
            self.seen += 1
            if not self.seen & self.mask:
                self._carry()

    def _carry(self) -> None:
        for level in range(1, LEVELS):
            self.levels[level] += self.levels[level - 1]
            self.levels[level - 1][:] = 0
            if self.seen & (self.mask << (level * self.power)):
                break

    def total(self) -> npt.NDArray[Any]:
        total = self.levels[0].copy()
        for level in self.levels[1:]:
            total += level
        return total


def ceil_log2(value: int) -> int:
    """ATen's CeilLog2: 1 up to 2, else ⌈log2(value)⌉."""
    return 1 if value <= 2 else (value - 1).bit_length()
