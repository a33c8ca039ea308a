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

import numpy as np
import torch

from engine.kernels import multislerp_compiled as steps
from engine.kernels import torch_order
from engine.kernels.torch_order import Array

Read = Callable[[int, int, int], torch.Tensor]


def reproduced(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether a tensor of this arithmetic dtype and device is merged here."""
    return torch_order.exact_here(dtype, device)


class InPieces:
    """One tensor: sources are the models, then the base where `with_base`; `weights` as
    merge_whole takes them (normalised already, in the arithmetic dtype)."""

    def __init__(
        self, read: Read, sources: list[int], numel: int, *, step: int, with_base: bool,
        eps: float, weights: torch.Tensor,
    ) -> None:  # fmt: skip
        self.read, self.sources, self.numel = read, sources, numel
        self.step = max(torch_order.ALIGN, step // torch_order.ALIGN * torch_order.ALIGN)
        self.with_base, self.eps = with_base, eps
        self.dtype, self.weights = weights.dtype, weights
        self.narrow = self.dtype == torch.bfloat16
        self.work = np.float64 if self.dtype == torch.float64 else np.float32
        self.w = self._numbers(weights)
        self.count = len(weights)

    def _numbers(self, values: torch.Tensor) -> Array:
        return values.to(torch.float64 if self.work is np.float64 else torch.float32).numpy()

    def measure(self) -> bool:
        """The four passes; False where the directions cancel (their weighted mean is zero),
        True where the output is then made by chunk()."""
        norms = torch_order.RowNorms(self.count, self.numel, self.dtype)
        for vectors in self._pieces():
            norms.add_values(vectors)
        self.norms = norms.result()
        self.divisors = self._numbers(self.norms + self.eps)
        mean_norms = torch_order.RowNorms(1, self.numel, self.dtype)
        for vectors in self._pieces():
            mean_norms.add_values(self._mean(self._units(vectors))[None])
        self.mean_norm = mean_norms.result()[0]
        if self.mean_norm < self.eps:
            return False
        sums = torch_order.RowSums(self.count, self.numel, self.dtype)
        for vectors in self._pieces():
            units = self._units(vectors)
            dots = np.empty_like(units)
            steps.products(units, self._direction(units), self.narrow, dots)
            sums.add_values(dots)
        self.dots = self._numbers(sums.result())
        lengths = torch_order.RowNorms(1, self.numel, self.dtype)
        for vectors in self._pieces():
            units = self._units(vectors)
            lengths.add_values(self._tangent(units, self._direction(units))[None])
        length = lengths.result()[0] + self.eps
        # merge_whole's scalars, as its torch operations on 0-d tensors make them
        self.cos, self.ratio = torch.cos(length), torch.sin(length) / length
        self.scale = (self.norms * self.weights).sum()
        return True

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output, once measured."""
        vectors, base = self._vectors(start, count)
        units = self._units(vectors)
        direction = self._direction(units)
        out = np.empty_like(direction)
        cos, ratio, scale = (self.work(float(t)) for t in (self.cos, self.ratio, self.scale))
        steps.mapped(direction, self._tangent(units, direction), cos, ratio, scale,
                     self.narrow, out)  # fmt: skip
        if base is not None:
            steps.added(out, base, self.narrow)
        return torch.from_numpy(out).to(self.dtype)

    def _pieces(self) -> Iterator[Array]:
        for start in range(0, self.numel, self.step):
            yield self._vectors(start, min(self.step, self.numel - start))[0]

    def _vectors(self, start: int, count: int) -> tuple[Array, Array | None]:
        """The models (less the base) over [start, start + count), and the base."""
        xs = [self._numbers(self.read(s, start, count)) for s in self.sources]
        if not self.with_base:
            return np.stack(xs), None
        out = np.empty((self.count, count), self.work)
        steps.difference(np.stack(xs[:-1]), xs[-1], self.narrow, out)
        return out, xs[-1]

    def _units(self, vectors: Array) -> Array:
        out = np.empty_like(vectors)
        steps.units(vectors, self.divisors, self.narrow, out)
        return out

    def _mean(self, units: Array) -> Array:
        out = np.empty(units.shape[1], self.work)
        steps.weighted_mean(units, self.w, self.narrow, self.work(0), out)
        return out

    def _direction(self, units: Array) -> Array:
        """The weighted mean of the unit vectors, divided by its norm."""
        mean = self._mean(units)
        steps.scaled(mean, self.work(float(self.mean_norm)), self.narrow, mean)
        return mean

    def _tangent(self, units: Array, direction: Array) -> Array:
        out = np.empty_like(direction)
        steps.tangent(units, direction, self.dots, self.w, self.narrow, self.work(0), out)
        return out
