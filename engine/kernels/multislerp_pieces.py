"""multislerp of a tensor larger than a chunk, read a piece at a time, to mergekit's bits.

MultiSlerp.merge_whole's arithmetic needs four statistics of the whole tensor, one after the
other: each vector's norm, the norm of the weighted mean of the unit vectors, each unit
vector's dot product with that mean, and the length of the tangent. Each is summed here in
torch's order (torch_order.py), in a pass over the tensor a piece of each input at a time; the
elementwise steps between are merge_whole's torch operations, compiled
(multislerp_compiled.py). The output is then made piece by piece from those statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from engine.kernels import multislerp_compiled as steps
from engine.kernels import torch_order
from engine.kernels.torch_order import Array

ReadInto = Callable[[int, int, torch.Tensor], object]  # (source, start, out): out filled


class InPieces:
    """One tensor: sources are the models, then the base where `with_base`; `weights` as
    merge_whole takes them (normalised already, in the arithmetic dtype)."""

    def __init__(
        self, read_into: ReadInto, sources: list[int], numel: int, *, step: int, with_base: bool,
        eps: float, weights: torch.Tensor,
    ) -> None:  # fmt: skip
        self.read_into, self.sources, self.numel = read_into, sources, numel
        self.step = max(torch_order.ALIGN, step // torch_order.ALIGN * torch_order.ALIGN)
        self.with_base, self.eps = with_base, eps
        self.dtype, self.weights = weights.dtype, weights
        self.narrow = self.dtype == torch.bfloat16
        self.work = np.float64 if self.dtype == torch.float64 else np.float32
        self.zero = self.work(0)
        self.w = self._numbers(weights)
        self.count = len(weights)
        # the inputs of a piece, read into one buffer (bfloat16 seen by numba as its bits),
        # and a pass's results: flat, so that a piece's rows are contiguous whatever its size
        # (numba vectorises contiguous rows only)
        self._held = torch.empty(len(sources) * min(self.step, numel), dtype=self.dtype)
        held = self._held.view(torch.int16) if self.narrow else self._held
        self._xs = held.numpy().view(np.uint16) if self.narrow else held.numpy()
        self._results = np.empty(self.count * min(self.step, numel), self.work)

    def _numbers(self, values: torch.Tensor) -> Array:
        return values.to(torch.float64 if self.work is np.float64 else torch.float32).numpy()

    def _scalar(self, value: torch.Tensor) -> Any:
        return self.work(float(value))

    def measure(self) -> bool:
        """The four passes; False where the directions cancel (their weighted mean is zero),
        True where the output is then made by chunk()."""
        norms = torch_order.RowNorms(self.count, self.numel, self.dtype)
        for xs in self._pieces():
            out = self._rows(self.count, xs.shape[1])
            steps.vectors(xs, self.with_base, self.narrow, out)
            norms.add_values(out)
        self.norms = norms.result()
        self.divisors = self._numbers(self.norms + self.eps)
        mean_norms = torch_order.RowNorms(1, self.numel, self.dtype)
        for xs in self._pieces():
            out = self._rows(1, xs.shape[1])
            steps.means(xs, self.with_base, self.divisors, self.w, self.zero, self.narrow,
                        self.zero, out[0])  # fmt: skip
            mean_norms.add_values(out)
        self.mean_norm = mean_norms.result()[0]
        if self.mean_norm < self.eps:
            return False
        sums = torch_order.RowSums(self.count, self.numel, self.dtype)
        for xs in self._pieces():
            out = self._rows(self.count, xs.shape[1])
            steps.dot_terms(xs, self.with_base, self.divisors, self.w,
                            self._scalar(self.mean_norm), self.narrow, self.zero, out)  # fmt: skip
            sums.add_values(out)
        self.dots = self._numbers(sums.result())
        lengths = torch_order.RowNorms(1, self.numel, self.dtype)
        for xs in self._pieces():
            out = self._rows(1, xs.shape[1])
            steps.tangents(xs, self.with_base, self.divisors, self.w, self._scalar(self.mean_norm),
                           self.dots, self.narrow, self.zero, out[0])  # fmt: skip
            lengths.add_values(out)
        length = lengths.result()[0] + self.eps
        # merge_whole's scalars, as its torch operations on 0-d tensors make them
        cos, ratio = torch.cos(length), torch.sin(length) / length
        scale = (self.norms * self.weights).sum()
        self.scalars = tuple(self._scalar(t) for t in (self.mean_norm, cos, ratio, scale))
        return True

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output, once measured."""
        out = np.empty(count, self.work)
        mean_norm, cos, ratio, scale = self.scalars
        for at in range(0, count, self.step):
            xs = self._load(start + at, min(self.step, count - at))
            piece = out[at : at + xs.shape[1]]
            steps.outputs(xs, self.with_base, self.divisors, self.w, mean_norm, self.dots, cos,
                          ratio, scale, self.narrow, self.zero, piece)  # fmt: skip
        return torch.from_numpy(out).to(self.dtype)

    def _pieces(self) -> Iterator[Array]:
        for start in range(0, self.numel, self.step):
            yield self._load(start, min(self.step, self.numel - start))

    def _load(self, start: int, count: int) -> Array:
        """The inputs over [start, start + count), as rows of the held buffer."""
        rows = len(self.sources)
        held = self._held[: rows * count].view(rows, count)
        for row, source in enumerate(self.sources):
            self.read_into(source, start, held[row])
        return self._xs[: rows * count].reshape(rows, count)

    def _rows(self, rows: int, count: int) -> Array:
        return self._results[: rows * count].reshape(rows, count)
