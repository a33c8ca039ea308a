"""TIES on the CPU, compiled with numba: each step is one pass over memory on every core.

kernels.Kernels computes TIES with a dozen whole-chunk torch ops per term, gathers |δ| and
partitions it for the top-k, and keeps a running tie quota that forces chunks into order;
on 2 cores that took ~49 ns per parameter of a 1.7B model's layer (this one: ~17). Here:

- **Selection** of the k-th largest |δ| is exact and sort-free: two 16-bit radix histograms
  of the float32 bit patterns (ordered like the values, as |δ| ≥ 0). The tied entries kept
  (the first ones in flat order) end at a cutoff index found by one scan, so each element
  decides on its own — `keep = bits > threshold or (bits == threshold and index < cutoff)` —
  and chunks split across threads. A tensor of up to `in_memory` elements keeps its |δ| bits
  in one buffer between passes; a larger one (embeddings) is read again for each pass.
- **Combination** is one fused loop per element over all terms.

The arithmetic is kernels.Kernels._ties', bit for bit: float32, coefficients and λ rounded to
float32, sums in term order, one rounding to the output dtype (nearest-even). Only NaN payloads
may differ: a NaN is written as the canonical quiet NaN, as linear_kernels.narrow does.

Compiled code is cached on disk (numba's `cache=True`): the first TIES merge of an installation
compiles for a few seconds; later processes load it.
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numba
import numpy as np
import numpy.typing as npt
from numba import types
from numba.extending import overload

from engine.memory import keep_freed_memory
from engine.plan import Plan, TensorPlan, TiesSettings

SUPPORTED_DTYPES = frozenset({"BF16", "F16", "F32"})
THREADS = max(1, min(4, os.cpu_count() or 1))
_MIN_SPLIT = 1 << 16  # below this many elements one thread does it all
_BINS = 1 << 16

Array = npt.NDArray[Any]
_jit = numba.njit(nogil=True, cache=True)


def handles(plan: Plan, device: str) -> bool:
    """Whether this module computes every tensor a TIES plan does not copy."""
    if device != "cpu" or plan.ties is None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op != "ties" or tensor.dtype not in SUPPORTED_DTYPES:
            return False
        sources = {t.source for t in tensor.terms} | {plan.ties.base}
        dtypes = {plan.checkpoints[source].tensors[tensor.read_name].dtype for source in sources}
        if len(dtypes) != 1 or not dtypes <= SUPPORTED_DTYPES:  # one (validate.py checks it)
            return False
    return True


# -- compiled kernels: each works on elements [lo, hi) so that threads can split the work ------
def _as_float32(value: Any) -> Any:
    raise NotImplementedError  # only called from compiled code


@overload(_as_float32, inline="always")
def _as_float32_impl(value: Any) -> Any:
    """BF16 arrives as its uint16 bit pattern (the upper half of a float32), F32 as itself
    (F16 is widened by numpy first)."""
    if isinstance(value, types.Integer):

        def from_bf16_bits(value: Any) -> Any:
            return np.uint32(np.uint32(value) << np.uint32(16)).view(np.float32)

        return from_bf16_bits

    def as_is(value: Any) -> Any:
        return np.float32(value)

    return as_is


@_jit
def _abs_delta_bits(
    model: Array, base: Array, out: Array, histogram: Array, lo: int, hi: int
) -> None:
    """|model − base| as float32 bit patterns, counted by their upper 16 bits."""
    model, base, out = model[lo:hi], base[lo:hi], out[lo:hi]  # see _combine
    for j in range(hi - lo):
        delta = np.float32(_as_float32(model[j]) - _as_float32(base[j]))
        bits = np.float32(abs(delta)).view(np.uint32)
        out[j] = bits
        histogram[bits >> np.uint32(16)] += 1


@_jit
def _low_histogram(bits: Array, high: int, histogram: Array, lo: int, hi: int) -> None:
    bits = bits[lo:hi]  # see _combine
    for j in range(hi - lo):
        if bits[j] >> np.uint32(16) == high:
            histogram[bits[j] & np.uint32(0xFFFF)] += 1


@_jit
def _find_tie(bits: Array, threshold: int, needed: int) -> tuple[int, int]:
    """(index after the `needed`-th entry equal to threshold, or -1; how many were seen)."""
    seen = 0
    for j in range(bits.size):
        if bits[j] == threshold:
            seen += 1
            if seen == needed:
                return j + 1, seen
    return -1, seen


def _store(out: Any, j: int, value: Any) -> None:
    raise NotImplementedError  # only called from compiled code


@overload(_store, inline="always")
def _store_impl(out: Any, j: Any, value: Any) -> Any:
    """Into a BF16 output (uint16 bits): round to nearest-even, NaN as the canonical quiet
    NaN (as linear_kernels.narrow); into a float32 one: as is."""
    if isinstance(out.dtype, types.Integer):

        def to_bf16(out: Any, j: Any, value: Any) -> Any:
            bits = np.float32(value).view(np.uint32)
            half = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
            rounded = np.uint16(np.uint32(bits + half) >> np.uint32(16))
            out[j] = rounded if value == value else np.uint16(0x7FC0)  # a select, not a branch

        return to_bf16

    def as_is(out: Any, j: Any, value: Any) -> Any:
        out[j] = value

    return as_is


_BLOCK = 512  # elements per inner loop: its five float32 rows stay in the L1 cache


@_jit
def _combine(
    base: Array, terms: Array, first: int, coefficients: Array, thresholds: Array,
    cutoffs: Array, trim: bool, normalize: bool, lambda_: Any, out: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """base + λ·(disjoint mean of the trimmed, weighted deltas agreeing with their sum's sign);
    `first` is the flat index of element 0 (for the tie cutoffs). Term by term over a block,
    every step a select rather than a branch, so the loops vectorise."""
    zero, one = np.float32(0.0), np.float32(1.0)
    b = np.empty(_BLOCK, np.float32)
    positive, negative = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32)
    up, down = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32)
    for start in range(lo, hi, _BLOCK):
        width = min(_BLOCK, hi - start)
        # slices, indexed from 0 by the loop counter: numba then drops its negative-index
        # checks and the loops vectorise (measured 3x)
        block_base, block_out = base[start : start + width], out[start : start + width]
        for q in range(width):
            b[q] = _as_float32(block_base[q])
            positive[q], negative[q], up[q], down[q] = zero, zero, zero, zero
        for i in range(terms.shape[0]):
            row, c, threshold = terms[i, start : start + width], coefficients[i], thresholds[i]
            ties_end = cutoffs[i] - first - start  # tied entries before it are kept
            for q in range(width):
                delta = np.float32(_as_float32(row[q]) - b[q])
                if trim:
                    bits = np.float32(abs(delta)).view(np.uint32)
                    kept = bits > threshold or (bits == threshold and q < ties_end)
                    delta = delta if kept else np.float32(delta * zero)  # ±0, as masking did
                if c != one:
                    delta = np.float32(delta * c)
                # NaN goes into both sums (so it reaches the output, as in the torch kernels)
                positive[q] = np.float32(positive[q] + (zero if delta <= zero else delta))
                negative[q] = np.float32(negative[q] + (zero if delta >= zero else delta))
                up[q] = np.float32(up[q] + (c if delta > zero else zero))
                down[q] = np.float32(down[q] + (c if delta < zero else zero))
        for q in range(width):
            elected_up = not np.float32(positive[q] + negative[q]) < zero  # zero counts as +
            mixed = positive[q] if elected_up else negative[q]
            if normalize:
                divisor = up[q] if elected_up else down[q]
                mixed = np.float32(mixed / (divisor if divisor != zero else one))
            if lambda_ != one:
                mixed = np.float32(mixed * lambda_)
            positive[q] = np.float32(b[q] + np.float32(mixed + zero))  # the result
        for q in range(width):  # a loop of its own: it vectorises only alone (measured 5x)
            _store(block_out, q, positive[q])


# -- the driver ---------------------------------------------------------------------------------
class TiesKernels:
    def __init__(
        self,
        plan: Plan,
        *,
        chunk_elements: int,
        check_cancel: Callable[[], None] | None = None,
    ) -> None:
        assert plan.ties is not None
        self.plan = plan
        self.settings: TiesSettings = plan.ties
        keep_freed_memory()  # chunk buffers are reused, not page-faulted in again
        # Raises when the merge is canceled; called per chunk of the selection passes, which
        # read a whole tensor up to three times before its first output byte.
        self.check_cancel = check_cancel or (lambda: None)
        self.chunk_elements = chunk_elements
        self.in_memory = 8 * chunk_elements  # every layer weight at the default chunk size

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        numel = math.prod(tensor.shape)
        # A tensor that fits is read once, for the selection and the combination alike.
        whole = self._inputs(tensor, 0, numel) if numel <= self.in_memory else None
        step = numel if whole is not None else self.chunk_elements

        def inputs(start: int, count: int) -> tuple[Array, Array]:  # base, terms
            if whole is None:
                return self._inputs(tensor, start, count)
            return whole[0][start : start + count], whole[1][:, start : start + count]

        trim = self.settings.density < 1.0
        thresholds, cutoffs = self._trim_points(len(tensor.terms), numel, step, inputs)
        coefficients = np.array([t.coefficient for t in tensor.terms], np.float32)
        lambda_ = np.float32(self.settings.lambda_)
        # A tensor read whole is combined whole: a slice of its rows would not be contiguous,
        # and numba's code for such arrays does not vectorise (measured 3x slower).
        for start in range(0, numel, step):
            self.check_cancel()
            count = min(step, numel - start)
            base, terms = inputs(start, count)
            out = np.empty(count, np.uint16 if tensor.dtype == "BF16" else np.float32)
            _parallel(
                _combine, count, base, terms, start, coefficients, thresholds, cutoffs,
                trim, self.settings.normalize, lambda_, out,
            )  # fmt: skip
            if tensor.dtype == "F16":
                out = out.astype(np.float16)  # round to nearest-even, as torch does
            data = out.view(np.uint8).data
            piece = self.chunk_elements * out.itemsize  # the writer's unit of buffering
            for at in range(0, len(data), piece):
                yield data[at : at + piece]

    # -- selection ------------------------------------------------------------------------------
    def _trim_points(
        self, term_count: int, numel: int, step: int,
        inputs: Callable[[int, int], tuple[Array, Array]],
    ) -> tuple[Array, Array]:  # fmt: skip
        """Per term, what `_select` finds (thresholds, tie cutoffs); zeros where nothing is
        trimmed. `inputs(start, count)` gives (base, terms) of those elements."""
        thresholds, cutoffs = np.zeros(term_count, np.uint32), np.zeros(term_count, np.int64)
        if self.settings.density < 1.0 and numel:
            k = max(1, math.ceil(self.settings.density * numel))
            for i in range(term_count):

                def delta_inputs(start: int, count: int, i: int = i) -> tuple[Array, Array]:
                    base, terms = inputs(start, count)
                    return terms[i], base

                thresholds[i], cutoffs[i] = self._select(numel, k, step, delta_inputs)
        return thresholds, cutoffs

    def _select(
        self, numel: int, k: int, step: int, delta_inputs: Callable[[int, int], tuple[Array, Array]]
    ) -> tuple[int, int]:
        """(bit pattern of the k-th largest |model − base|, index after the last tied entry
        kept), reading `step` elements at a time: one step keeps |δ| for the later passes,
        several compute it again for each."""
        high_counts = np.zeros((THREADS, _BINS), np.int64)

        def passes() -> Iterator[tuple[int, Array]]:  # (first index, |δ| bits) per step
            for start in range(0, numel, step):
                self.check_cancel()
                count = min(step, numel - start)
                model, base = delta_inputs(start, count)
                bits = np.empty(count, np.uint32)
                _parallel(_abs_delta_bits, count, model, base, bits, high_counts, split=True)
                yield start, bits

        kept = list(passes()) if step >= numel else None
        if kept is None:
            for _ in passes():  # the histogram of |δ|'s upper halves
                pass

        def again() -> Iterator[tuple[int, Array]]:
            return iter(kept) if kept is not None else passes()

        high, above_high, remaining = _pick_bin(high_counts.sum(axis=0), k)
        low_counts = np.zeros((THREADS, _BINS), np.int64)
        for _, bits in again():
            _parallel(_low_histogram, bits.size, bits, high, low_counts, split=True)
        low, above_low, _ = _pick_bin(low_counts.sum(axis=0), remaining)
        threshold = (high << 16) | low
        needed = k - above_high - above_low  # tied entries kept: the first ones in flat order
        for start, bits in again():
            self.check_cancel()
            cutoff, seen = _find_tie(bits, threshold, needed)
            if cutoff >= 0:
                return threshold, start + cutoff
            needed -= seen
        raise AssertionError("the k-th largest |δ| was not found again")

    # -- reading --------------------------------------------------------------------------------
    def _inputs(self, tensor: TensorPlan, start: int, count: int) -> tuple[Array, Array]:
        """The base's elements and every term's as the rows of one array, all of one dtype
        (handles()): BF16 as its uint16 bits, F16 widened to float32, F32 as is; the reads
        side by side."""
        sources = [self.settings.base, *(t.source for t in tensor.terms)]
        infos = [self.plan.checkpoints[s].tensors[tensor.read_name] for s in sources]
        rows = np.empty(
            (len(sources), count), np.uint16 if infos[0].dtype == "BF16" else np.float32
        )

        def read(source: int, row: Array) -> None:
            info = self.plan.checkpoints[source].tensors[tensor.read_name]
            first_byte = start * info.itemsize
            if info.dtype != "F16":  # the bytes as they are
                self.plan.read_into(source, tensor.read_name, row.view(np.uint8).data, first_byte)
                return
            raw = np.empty(count * info.itemsize, np.uint8)
            self.plan.read_into(source, tensor.read_name, raw.data, first_byte)
            row[:] = raw.view(np.float16)

        _side_by_side(
            [functools.partial(read, s, row) for s, row in zip(sources, rows, strict=True)]
        )
        return rows[0], rows[1:]


# -- threads ------------------------------------------------------------------------------------
def _parallel(kernel: Any, n: int, *args: Any, split: bool = False) -> None:
    """Run `kernel(*args, lo, hi)` over [0, n) in up to THREADS slices (the kernels release
    the GIL). With `split`, the last argument has a row per slice (a histogram each)."""
    slices = THREADS if n >= _MIN_SPLIT else 1
    bounds = [n * s // slices for s in range(slices + 1)]
    _side_by_side(
        [
            functools.partial(
                kernel, *args[:-1], args[-1][s] if split else args[-1], bounds[s], bounds[s + 1]
            )
            for s in range(slices)
        ]
    )


def _side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run the calls on the caller's thread and the pool's, all at once."""
    futures = [_pool().submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


def _pool() -> ThreadPoolExecutor:
    """Helper threads for the slices after the first (the caller's thread runs that one)."""
    return _pool_of(os.getpid())


@functools.cache
def _pool_of(pid: int) -> ThreadPoolExecutor:
    """One per process: a forked child (a prefork worker) has none of its parent's threads."""
    return ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="ties")


def _pick_bin(counts: Array, k: int) -> tuple[int, int, int]:
    """(bin holding the k-th largest, entries in higher bins, k's rank inside that bin)."""
    from_top = np.cumsum(counts[::-1])
    position = int(np.searchsorted(from_top, k))
    above = int(from_top[position - 1]) if position > 0 else 0
    return _BINS - 1 - position, above, k - above
