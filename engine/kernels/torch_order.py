"""torch's CPU reductions over the last dimension, reproduced to the bit a piece at a time.

mergekit reduces whole tensors (`torch.norm(x, dim=-1)`, `x.sum(-1)`); Layerswap reads a large
tensor a piece at a time. A float sum's bits depend on the order of its additions, so these
classes add in torch's own order, carried from piece to piece:

- the L2 norm (ReduceOpsKernel's vectorised path for float32, float64 and bfloat16): one
  accumulator vector of W lanes, each lane adding x² of every W-th element (a bfloat16 vector
  of 2W elements widened to two float32 halves, the first half added first); then the lanes
  added left to right, then the elements past the last whole vector one by one; the square root
  taken in the accumulator's dtype and rounded to the input's;
- the sum (SumKernel's cascade): vectors of W lanes (a bfloat16 vector's two halves added
  first), four at a time into four accumulators, carried up a level after every 2^p steps
  (p = max(4, ⌈log2(steps)⌉ // 4)), up to four levels; then the leftover vectors into the
  first accumulator, the four added, and the sum of the elements past the last vector plus
  each lane in turn (a row shorter than a vector: four scalar accumulators, in turn).

Two things depend on how the installed torch was built for this CPU, so they are measured, not
assumed (`order_here`): W, the lanes of its vectors (8 float32 lanes where the kernel runs at
AVX2's width, as torch 2.13's reductions do on AVX2 and AVX-512 CPUs alike; 16 where one runs
at AVX-512's; float64 half that), and whether the norm's elements past the last vector are
added plainly (x² rounded, then added: torch's DEFAULT build) or in fours plainly and the rest
by a fused multiply-add (its AVX2 build, as the compiler emitted that loop). A few rows are
reduced every known way at first use; where no candidate equals torch on all of them, nothing
is reproduced (`exact_here` is False) and callers take their own path. Each output row is
reduced by one thread in that order whatever torch's thread count. A piece must start at a
multiple of `ALIGN` elements of its row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numba
import numpy as np
import torch

from engine.kernels.float_bits import as_float32
from engine.kernels.row_cascade import LEVELS, ceil_log2

Array = Any  # a numpy array, as compiled code takes it
_jit = numba.njit(nogil=True, cache=True)
ILP = 4  # vectors the cascade adds side by side
ALIGN = 512  # a multiple of every ILP step: 4 vectors of 32 bfloat16 (AVX-512)
SUPPORTED = (torch.float32, torch.float64, torch.bfloat16)


@dataclass(frozen=True)
class Order:
    """How torch's CPU kernels add, for one accumulator dtype."""

    lanes: int  # lanes of a vector of the accumulator's dtype
    fused_tail: bool  # the norm's elements past the last vector: in fours x² + s, the rest fma


def exact_here(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the reductions of `dtype` tensors on `device` are reproduced here: torch's CPU
    kernels, where their order is one of those known (order_here); float16's norm takes
    another path, not reproduced."""
    return device.type == "cpu" and dtype in SUPPORTED and order_here(dtype) is not None


def order_here(dtype: torch.dtype) -> Order | None:
    """The order torch adds `dtype` in on this machine, or None where it is none of those
    known. bfloat16 is added in float32 and shares float32's order."""
    return _measured(torch.float64 if dtype == torch.float64 else torch.float32)


@functools.cache
def _measured(dtype: torch.dtype) -> Order | None:
    dtypes = [dtype] if dtype == torch.float64 else [dtype, torch.bfloat16]
    return next((o for o in candidates(dtype) if all(agrees(o, d) for d in dtypes)), None)


def candidates(dtype: torch.dtype) -> list[Order]:
    """The orders known for an accumulator dtype: AVX2's lanes or AVX-512's, either tail."""
    lanes = 4 if dtype == torch.float64 else 8
    return [Order(w, fused) for w in (lanes, 2 * lanes) for fused in (False, True)]


def agrees(order: Order, dtype: torch.dtype) -> bool:
    """Whether norms and sums in `order` equal torch's on rows of every kind of tail and
    cascade step up to a few carries."""
    generator = torch.Generator().manual_seed(0)
    scale = torch.logspace(-3, 3, 3, dtype=torch.float64).view(-1, 1)
    for length in (1, 2, 3, 4, 5, 7, 9, 12, 15, 17, 31, 33, 63, 100, 257, 700, 2100, 9000):
        rows = (torch.randn(3, length, dtype=torch.float64, generator=generator) * scale).to(dtype)
        norms, sums = RowNorms(3, length, dtype, order), RowSums(3, length, dtype, order)
        norms.add(rows)
        sums.add(rows)
        if not (torch.equal(norms.result(), torch.norm(rows, dim=-1))
                and torch.equal(sums.result(), rows.sum(-1))):  # fmt: skip
            return False
    return True


class _Rows:
    """A reduction of `rows` rows of `length` elements of `dtype`, fed pieces in order; in
    `order`, or the one measured here."""

    def __init__(
        self, rows: int, length: int, dtype: torch.dtype, order: Order | None = None
    ) -> None:
        if dtype not in SUPPORTED:
            raise ValueError(f"{dtype} reductions are not reproduced")
        order = order or order_here(dtype)
        if order is None:
            raise ValueError(f"torch's order of {dtype} reductions is not reproduced on this CPU")
        self.rows, self.length, self.dtype, self.order = rows, length, dtype, order
        self.narrow = dtype == torch.bfloat16
        self.acc_dtype = np.float64 if dtype == torch.float64 else np.float32
        self.lanes = order.lanes
        self.vector = 2 * self.lanes if self.narrow else self.lanes  # elements per load
        self.vectors = length // self.vector  # whole vectors in a row
        self.seen = 0

    def add(self, piece: torch.Tensor) -> None:
        """The next piece of every row: a (rows, count) tensor of the dtype."""
        self.add_values(self._numpy(piece))

    def add_values(self, x: Array) -> None:
        """add() of a piece given as a numpy array: bfloat16 bits, or the values as numbers
        (bfloat16 ones as float32)."""
        raise NotImplementedError

    def _numpy(self, piece: torch.Tensor) -> Array:
        """The piece as compiled code reads it: bfloat16 as its bits (uint16)."""
        if piece.shape != (self.rows, piece.shape[-1]) or piece.dtype != self.dtype:
            raise ValueError(f"expected {self.rows} rows of {self.dtype}")
        piece = piece.contiguous()
        if self.narrow:
            return piece.view(torch.int16).numpy().view(np.uint16)
        return piece.numpy()

    def _advance(self, count: int) -> tuple[int, bool]:
        """The piece's start in its row, and whether it is the last piece."""
        start = self.seen
        if start % ALIGN or start + count > self.length:
            raise ValueError(f"a piece of {count} elements at {start} of {self.length}")
        self.seen += count
        return start, self.seen == self.length

    def _widened(self, x: Array) -> Array:
        """Elements widened to the accumulator's dtype (bfloat16 bits exactly)."""
        if x.dtype == np.uint16:
            return (x.astype(np.uint32) << 16).view(np.float32)
        return x.astype(self.acc_dtype)

    def _load(self, x: Array, vector: int) -> Array:
        """One vector's lanes as the sum loads it: a bfloat16 vector's two halves added."""
        part = self._widened(x[vector * self.vector : (vector + 1) * self.vector])
        if self.narrow:
            return part[: self.lanes] + part[self.lanes :]
        return part

    def _rounded(self, values: Array) -> torch.Tensor:
        return torch.from_numpy(np.asarray(values, self.acc_dtype)).to(self.dtype)


class RowNorms(_Rows):
    """torch.norm(x, dim=-1) of a (rows, length) tensor in float32, float64 or bfloat16."""

    def __init__(
        self, rows: int, length: int, dtype: torch.dtype, order: Order | None = None
    ) -> None:
        super().__init__(rows, length, dtype, order)
        self.acc = np.zeros((rows, self.lanes), self.acc_dtype)
        self.tails: list[Array] = []

    def add_values(self, x: Array) -> None:
        start, last = self._advance(x.shape[1])
        whole = self.vectors * self.vector - start if last else x.shape[1]
        if self.narrow:
            _squares_narrow(self.acc, x, whole, self.lanes)
        else:
            _squares(self.acc, x, whole, self.lanes)
        if last:
            self.tails = [self._widened(row[whole:]) for row in x]

    def result(self) -> torch.Tensor:
        if self.seen != self.length:
            raise ValueError(f"{self.seen} of {self.length} elements were added")
        out = np.empty(self.rows, self.acc_dtype)
        for r in range(self.rows):
            total = self.acc[r, 0]
            for lane in self.acc[r, 1:]:
                total = total + lane
            tail = self.tails[r] if self.tails else ()
            plain = len(tail) // 4 * 4 if self.order.fused_tail else len(tail)
            for i, value in enumerate(tail):
                total = total + value * value if i < plain else _fused(value, total)
            out[r] = np.sqrt(total)
        return self._rounded(out)


class RowSums(_Rows):
    """x.sum(-1) of a (rows, length) tensor in float32, float64 or bfloat16 (summed in
    float32, the sum rounded once), rows ≥ 2: torch splits the sum of a single row between
    its threads, each thread's part in this order, so its bits depend on their count."""

    def __init__(
        self, rows: int, length: int, dtype: torch.dtype, order: Order | None = None
    ) -> None:
        if rows < 2:
            raise ValueError("a single row's sum is split between torch's threads")
        super().__init__(rows, length, dtype, order)
        self.steps = self.vectors // ILP  # the cascade's steps of ILP vectors
        self.power = max(4, ceil_log2(self.steps) // LEVELS)
        self.acc = np.zeros((rows, LEVELS, ILP, self.lanes), self.acc_dtype)
        self.rest: list[Array] = []

    def add_values(self, x: Array) -> None:
        start, last = self._advance(x.shape[1])
        step = ILP * self.vector
        count = self.steps - start // step if last else x.shape[1] // step
        _cascade(self.acc, x, count, start // step, self.power, self.lanes, self.narrow)
        if last:
            self.rest = [row[count * step :].copy() for row in x]

    def result(self) -> torch.Tensor:
        return self._rounded(self._totals())

    def mean(self) -> torch.Tensor:
        """x.mean(-1) as torch takes it: the sum in the accumulator's dtype divided there by
        the length, rounded once to the dtype."""
        return self._rounded(self._totals() / self.acc_dtype(self.length))

    def _totals(self) -> Array:
        """The sums in the accumulator's dtype."""
        if self.seen != self.length:
            raise ValueError(f"{self.seen} of {self.length} elements were added")
        out = np.empty(self.rows, self.acc_dtype)
        if not self.vectors:  # rows shorter than a vector: summed as scalars
            for r, row in enumerate(self.rest):
                out[r] = _scalar_sum(self._widened(row))
            return out
        for r in range(self.rows):
            acc = self.acc[r]
            first = acc[0].copy()
            for level in acc[1:]:
                first += level
            rest = self.rest[r] if self.rest else np.empty(0, np.uint16)
            leftover = self.vectors - self.steps * ILP  # whole vectors after the last step
            for v in range(leftover):
                first[0] += self._load(rest, v)
            for k in range(1, ILP):
                first[0] += first[k]
            total = self.acc_dtype(0)
            for value in self._widened(rest[leftover * self.vector :]):
                total = total + value
            for lane in first[0]:
                total = total + lane
            out[r] = total
        return out


@_jit
def _squares(acc: Array, x: Array, count: int, lanes: int) -> None:
    """acc[r, lane] += x² of the row's elements [0, count) in lane order."""
    for r in range(x.shape[0]):
        row = x[r]
        for d in range(0, count, lanes):
            for lane in range(lanes):
                value = row[d + lane]
                acc[r, lane] += value * value


@_jit
def _squares_narrow(acc: Array, x: Array, count: int, lanes: int) -> None:
    """_squares of bfloat16 bits: each vector of 2·lanes elements as two halves, in order."""
    for r in range(x.shape[0]):
        row = x[r]
        for d in range(0, count, 2 * lanes):
            for half in range(2):
                for lane in range(lanes):
                    value = as_float32(row[d + half * lanes + lane])
                    acc[r, lane] += value * value


@_jit
def _cascade(
    acc: Array, x: Array, steps: int, first: int, power: int, lanes: int, narrow: bool
) -> None:
    """`steps` cascade steps of ILP vectors from the start of each row of x, the first being
    step `first` of the whole row."""
    mask = (1 << power) - 1
    vector = 2 * lanes if narrow else lanes
    for r in range(x.shape[0]):
        row = x[r]
        level = acc[r]
        done = first
        for s in range(steps):
            for k in range(ILP):
                at = (s * ILP + k) * vector
                for lane in range(lanes):
                    if narrow:
                        value = as_float32(row[at + lane]) + as_float32(row[at + lanes + lane])
                    else:
                        value = row[at + lane]
                    level[0, k, lane] += value
            done += 1
            if done & mask == 0:
                for j in range(1, LEVELS):
                    for k in range(ILP):
                        for lane in range(lanes):
                            level[j, k, lane] += level[j - 1, k, lane]
                            level[j - 1, k, lane] = 0
                    if done & (mask << (j * power)):
                        break


def _scalar_sum(values: Array) -> Any:
    """A row shorter than one vector: four accumulators taking every fourth element, the
    elements past the last four into the first, then the four added in order."""
    acc = [values.dtype.type(0)] * ILP
    whole = len(values) // ILP * ILP
    for i in range(whole):
        acc[i % ILP] = acc[i % ILP] + values[i]
    for value in values[whole:]:
        acc[0] = acc[0] + value
    return acc[0] + acc[1] + acc[2] + acc[3]


def _fused(x: Any, total: Any) -> Any:
    """x·x + total rounded once to total's dtype, as a fused multiply-add gives it."""
    dtype = type(total)
    exact = Fraction(float(x)) ** 2 + Fraction(float(total))
    near = dtype(float(exact))  # float64: rounded once; float32: perhaps twice, so checked
    if dtype is np.float64 or not np.isfinite(near):
        return near
    around = (np.nextafter(near, dtype(-np.inf)), near, np.nextafter(near, dtype(np.inf)))
    return min(around, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))
