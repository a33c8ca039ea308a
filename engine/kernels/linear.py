"""Linear ops on the CPU, compiled with numba: one pass over the inputs' bytes, on every core.

A layer swap, a soup, task arithmetic and mergekit's `linear` compute only weighted sums. Here
every thread takes a slice of a chunk of the tensor, reads it from each term (raw bytes, a row
per term) and, a block of elements at a time, widens each term to float32, multiplies, sums and
rounds to the output dtype: no whole-chunk float32 temporaries. Two terms stored as the
output is (the commonest case) take a single loop, with no pass per step. A 1.7B soup of two
BF16 models took ~1.0 CPU-ns per element in numpy (reads included, one core), ~0.5 here.
torch, seconds to import, is never loaded.

The arithmetic is torch_kernels.Kernels' (torch's), bit for bit:

- `linear`: each term widened to float32 exactly, multiplied by its coefficient as a float32,
  summed in term order (a multiply, then an add: two roundings), rounded once to the output
  dtype (round-to-nearest-even);
- `weighted_sum` / `weighted_mean` (mergekit's linear): fused multiply-adds from zero in term
  order, as torch's addcmul_, then for the mean one division by Σ coefficients, summed in the
  order torch sums a row of fewer than 8 floats (more terms go to torch, whose order then
  depends on the CPU's vector width).

Only NaN payloads may differ (float_bits.py says how NaNs are written).

Compiled code is cached on disk (numba's `cache=True`): the first linear merge of an
installation compiles for a few seconds; later processes load it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import numpy.typing as npt

from engine.io.memory import keep_freed_memory
from engine.io.safetensors_format import TensorInfo
from engine.kernels.float_bits import fma, from_bf16, from_f16, to_bf16, to_f16
from engine.kernels.parallel import parallel
from engine.plan.model import Plan, TensorPlan

SUPPORTED_DTYPES = frozenset({"BF16", "F16", "F32"})
OPS = frozenset({"linear", "weighted_sum", "weighted_mean"})
MEAN_TERMS = 8  # torch sums this many coefficients or more in vector lanes (order varies)
_KINDS = {"BF16": 0, "F16": 1, "F32": 2}  # how the compiled code reads and writes each
_ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}

Array = npt.NDArray[Any]
_jit = numba.njit(nogil=True, cache=True)
_helper = numba.njit(cache=True)  # called by the kernels; LLVM inlines it there


def handles(plan: Plan, device: str) -> bool:
    """Whether this module can compute every tensor the plan does not copy."""
    if device != "cpu" or plan.ties is not None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op not in OPS or tensor.dtype not in SUPPORTED_DTYPES:
            return False
        if tensor.op == "weighted_mean" and len(tensor.terms) >= MEAN_TERMS:
            return False
        for term in tensor.terms:
            if (
                plan.checkpoints[term.source].tensors[tensor.read_name].dtype
                not in SUPPORTED_DTYPES
            ):
                return False
    return True


# -- the compiled kernel: works on elements [lo, hi) so that threads can split the work ----------
_BLOCK = 512  # elements per inner loop: its float32 rows stay in the L1 cache


# How a term adds to the running total, element by element (`x`: the term, widened):
_COPY, _MULTIPLY, _ADD, _FMA = 0, 1, 2, 3  # x; x·c; total + x·c; fma(x, c, total)


def _accumulator(widen: Any) -> Any:
    """The loop that adds a term, stored as `widen` reads it, to the total: compiled once per
    stored dtype, so that reading, widening and adding are one loop (measured 1.8x faster
    than widening into a buffer first)."""

    @_helper
    def accumulate(values: Array, start: int, width: int, c: Any, mode: int, total: Array) -> None:
        values = values[start : start + width]  # indexed from 0: the loops vectorise
        if mode == _COPY:
            for q in range(width):
                total[q] = widen(values[q])
        elif mode == _MULTIPLY:
            for q in range(width):
                total[q] = np.float32(widen(values[q]) * c)
        elif mode == _ADD:
            for q in range(width):
                total[q] = np.float32(total[q] + np.float32(widen(values[q]) * c))
        else:
            for q in range(width):
                total[q] = fma(widen(values[q]), c, total[q])

    return accumulate


@_helper
def _as_float32(value: Any) -> Any:
    return np.float32(value)


_accumulate_bf16 = _accumulator(from_bf16)
_accumulate_f16 = _accumulator(from_f16)
_accumulate_f32 = _accumulator(_as_float32)


@_helper
def _narrow(total: Array, kind: int, start: int, width: int, out: Array) -> None:
    """total[:width] rounded to the output dtype, into its bytes at element `start`."""
    if kind == 2:
        floats = out.view(np.float32)[start : start + width]
        for q in range(width):
            floats[q] = total[q]
    elif kind == 0:
        halves = out.view(np.uint16)[start : start + width]
        for q in range(width):
            halves[q] = to_bf16(total[q])
    else:
        halves = out.view(np.uint16)[start : start + width]
        for q in range(width):
            halves[q] = to_f16(total[q])


def _pair(widen: Any, narrow: Any) -> Any:
    """Two terms of one stored dtype into that dtype in a single loop: a soup of two models,
    a layer swap's averaged tensors, most linear merges. The same operations in the same
    order as the blocks below (x·1 is x, an added term quiets a NaN either way, ÷1 is
    exact), without a pass over a float32 block per step: a BF16 mean took 0.66 ns per
    element in the blocks on an AVX-512 Xeon, 0.24 here (bench/cpu_paths.py)."""

    @_helper
    def pair(a: Array, b: Array, ca: Any, cb: Any, fused: bool, divisor: Any, out: Array) -> None:
        zero = np.float32(0.0)
        if fused:
            for q in range(out.size):
                total = fma(widen(b[q]), cb, fma(widen(a[q]), ca, zero))
                out[q] = narrow(np.float32(total / divisor))
        else:
            for q in range(out.size):
                total = np.float32(widen(a[q]) * ca) + np.float32(widen(b[q]) * cb)
                out[q] = narrow(np.float32(total / divisor))

    return pair


_pair_bf16 = _pair(from_bf16, to_bf16)
_pair_f16 = _pair(from_f16, to_f16)
_pair_f32 = _pair(_as_float32, _as_float32)


@_jit
def _combine(
    rows: Array, kinds: Array, coefficients: Array, fused: bool, divisor: Any,
    out_kind: int, out: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """out = Σ coefficient·term over elements [lo, hi): multiply then add, or (`fused`) by
    fused multiply-adds from zero; then ÷ divisor unless it is 1."""
    zero, one = np.float32(0.0), np.float32(1.0)
    if rows.shape[0] == 2 and kinds[0] == kinds[1] == out_kind:
        c0, c1 = coefficients[0], coefficients[1]
        if out_kind == 2:
            a, b = rows[0].view(np.float32)[lo:hi], rows[1].view(np.float32)[lo:hi]
            _pair_f32(a, b, c0, c1, fused, divisor, out.view(np.float32)[lo:hi])
            return
        a, b = rows[0].view(np.uint16)[lo:hi], rows[1].view(np.uint16)[lo:hi]
        if out_kind == 0:
            _pair_bf16(a, b, c0, c1, fused, divisor, out.view(np.uint16)[lo:hi])
        else:
            _pair_f16(a, b, c0, c1, fused, divisor, out.view(np.uint16)[lo:hi])
        return
    total = np.empty(_BLOCK, np.float32)
    for start in range(lo, hi, _BLOCK):
        width = min(_BLOCK, hi - start)
        if fused:  # from zero, as torch's addcmul_ into zeros
            total[:width] = zero
        for i in range(rows.shape[0]):
            c, kind = coefficients[i], kinds[i]
            if fused:
                mode = _FMA
            elif i > 0:
                mode = _ADD
            else:  # as torch: the first term itself, or multiplied
                mode = _COPY if c == one else _MULTIPLY
            if kind == 0:
                _accumulate_bf16(rows[i].view(np.uint16), start, width, c, mode, total)
            elif kind == 1:
                _accumulate_f16(rows[i].view(np.uint16), start, width, c, mode, total)
            else:
                _accumulate_f32(rows[i].view(np.float32), start, width, c, mode, total)
        if divisor != one:
            for q in range(width):
                total[q] = np.float32(total[q] / divisor)
        _narrow(total, out_kind, start, width, out)


def row_sum(values: Array) -> np.float32:
    """Σ values in float32, in the order torch's CPU kernel sums a row shorter than one vector
    of its dtype (8 float32s: MEAN_TERMS; 16 bf16 or fp16 values, each widened): four running
    sums over groups of four, the rest added to the first, then the four added up."""
    assert values.size < 2 * MEAN_TERMS
    partial = [np.float32(0.0)] * 4
    groups = values.size // 4
    for i in range(groups * 4):
        partial[i % 4] = np.float32(partial[i % 4] + values[i])
    for value in values[groups * 4 :]:
        partial[0] = np.float32(partial[0] + value)
    total = partial[0]
    for value in partial[1:]:
        total = np.float32(total + value)
    return total


# -- the driver ---------------------------------------------------------------------------------
class LinearKernels:
    def __init__(self, plan: Plan, *, chunk_elements: int) -> None:
        self.plan = plan
        keep_freed_memory()  # output chunks are reused memory, not page-faulted in again
        # The compiled loops keep no chunk-sized temporaries, so whole chunks: the threads
        # are handed work once per chunk.
        self.step = max(1, chunk_elements)
        self._rows = np.empty((0, 0), np.uint8)

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        numel = math.prod(tensor.shape)
        inputs = [Input(self.plan, t.source, tensor.read_name) for t in tensor.terms]
        kinds = np.array([_KINDS[i.info.dtype] for i in inputs], np.int64)
        coefficients = np.array([t.coefficient for t in tensor.terms], np.float32)
        divisor = row_sum(coefficients) if tensor.op == "weighted_mean" else np.float32(1.0)
        rows = self._buffer(len(inputs), min(self.step, numel) * 4)
        combine = functools.partial(
            _combine, rows, kinds, coefficients, tensor.op != "linear", divisor,
            _KINDS[tensor.dtype],
        )  # fmt: skip
        for start in range(0, numel, self.step):
            count = min(self.step, numel - start)
            _read_ahead(inputs, start + count, min(self.step, numel - start - count))
            out = np.empty(count * _ITEMSIZE[tensor.dtype], np.uint8)  # the writer keeps it
            parallel(_read_and_combine, count, inputs, rows, start, combine, out)
            yield out.data

    def _buffer(self, terms: int, width: int) -> Array:
        """One row of raw input bytes per term, reused from tensor to tensor."""
        if self._rows.shape[0] < terms or self._rows.shape[1] < width:
            shape = (max(terms, self._rows.shape[0]), max(width, self._rows.shape[1]))
            self._rows = np.empty(shape, np.uint8)
        return self._rows[:terms]


@dataclass(frozen=True)
class Input:
    """One term's tensor, read as the plan's output sees it (vocabulary rows aligned)."""

    plan: Plan
    source: int
    name: str

    @property
    def info(self) -> TensorInfo:
        return self.plan.checkpoints[self.source].tensors[self.name]

    def read_into(self, buffer: memoryview, first_byte: int) -> None:
        self.plan.read_into(self.source, self.name, buffer, first_byte)


def _read_ahead(inputs: list[Input], start: int, count: int) -> None:
    """Have the kernel read elements [start, start + count) of every input into the page cache
    while this chunk is computed (the threads' reads of their slices, side by side in one
    file, do not look sequential to its own read-ahead). Advice only: an aligned vocabulary's
    rows lie elsewhere, and are read all the same."""
    if count <= 0:
        return
    for term in inputs:
        info = term.info
        fd, size = term.plan.checkpoints[term.source].fd(info.file), info.itemsize
        os.posix_fadvise(fd, info.start + start * size, count * size, os.POSIX_FADV_WILLNEED)


def _read_and_combine(
    inputs: list[Input], rows: Array, start: int, combine: Any, out: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """Elements [lo, hi) of the chunk at `start`: each thread reads its own part of the inputs
    (a copy out of the page cache, which costs about as much as the arithmetic), then
    combines it."""
    for term, row in zip(inputs, rows, strict=True):
        size = term.info.itemsize
        term.read_into(row[lo * size : hi * size].data, (start + lo) * size)
    combine(out, lo, hi)


def narrow(values: Array, dtype: str) -> Array:
    """float32 values rounded to `dtype` (a new array), as the compiled kernels round them."""
    values = np.ascontiguousarray(values, np.float32)
    out = np.empty(values.size * _ITEMSIZE[dtype], np.uint8)
    rows = values.reshape(1, -1).view(np.uint8)
    one = np.float32(1.0)
    parallel(_combine, values.size, rows, np.array([2]), np.array([one]), False, one,
             _KINDS[dtype], out)  # fmt: skip
    return out.view({"BF16": np.uint16, "F16": np.float16, "F32": np.float32}[dtype])
