"""TIES's exact top-k on the CPU, compiled with numba: which |δ| of a tensor are kept.

TIES keeps exactly k entries (TiesSettings.kept: ⌊density·n⌋, at least one): every |δ| above
the k-th largest, and of those equal to it the first ones in flat order. The answer is a pair
(threshold, cutoff): the float32 bit pattern of the k-th largest |δ| (ordered like the values,
as |δ| ≥ 0) and the flat index after the last tied entry kept, so that each element decides on
its own —
`keep = bits > threshold or (bits == threshold and index < cutoff)` — and chunks split across
threads.

It is found in one pass over the tensor, usually: the |δ| of a fixed sample of 16384 elements
bound the k-th largest from both sides; one pass counts the |δ| above the upper bound and
collects the few between the bounds (with their indices, in flat order), and those decide the
threshold and the cutoff. Where the bounds miss (a sample cannot promise), or too many |δ| lie
between them (many equal values), the exact radix select takes over: a histogram of the upper
16 bits of every |δ| bounds it instead (to one bin), then either the same collection, or, for
a bin too full to collect, a histogram of the lower 16 bits and a scan for the tied entries.
Tensors held in memory are sampled; larger ones (read a chunk at a time) go straight to the
radix select, whose histogram pass replaces the sample.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any, cast

import numba
import numpy as np
import numpy.typing as npt
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from engine.kernels.float_bits import as_float32
from engine.kernels.parallel import MIN_SPLIT, THREADS, parallel, side_by_side

Array = npt.NDArray[Any]
# (start, count) -> (model, base): those elements of a term and of the base
DeltaInputs = Callable[[int, int], tuple[Array, Array]]
_jit = numba.njit(nogil=True, cache=True)
_BINS = 1 << 16
_SAMPLE = 1 << 14
_SPREAD = 0x9E3779B1  # sample positions i·_SPREAD mod n: spread over the tensor, its rows too
_COLLECTED = 8  # the most collected between the bounds: 1/_COLLECTED of the elements
_ALL = 0xFFFFFFFF  # above every |δ| bit pattern, NaN included


# -- compiled kernels: each works on elements [lo, hi) so that threads can split the work -------
@_jit
def _abs_delta_bits(
    model: Array, base: Array, out: Array, histogram: Array, lo: int, hi: int
) -> None:
    """|model − base| as float32 bit patterns, counted by their upper 16 bits."""
    # slices, indexed from 0 by the loop counter: numba then drops its negative-index checks
    model, base, out = model[lo:hi], base[lo:hi], out[lo:hi]
    for j in range(hi - lo):
        delta = np.float32(as_float32(model[j]) - as_float32(base[j]))
        bits = np.float32(abs(delta)).view(np.uint32)
        out[j] = bits
        histogram[bits >> np.uint32(16)] += 1


@_jit
def _low_histogram(bits: Array, high: int, histogram: Array, lo: int, hi: int) -> None:
    bits = bits[lo:hi]
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


@_jit
def _kth_largest(values: Array, rank: int) -> int:
    """The `rank`-th largest of the bit patterns (1 ≤ rank ≤ size), exactly: the values are
    counted by their offset from the smallest, in 2^16 bins, and narrowed to the bin holding
    the answer until a bin is one value. The |δ| of BF16 weights take few distinct values,
    where numpy's introselect degrades (107 ns an element on 2.5M |δ| of 158 values); here a
    pass costs a few ns an element, and such a range takes one pass."""
    lo, hi = np.int64(values.min()), np.int64(values.max())
    current = values
    while True:
        shift = 0
        while (hi - lo) >> shift >= _BINS:
            shift += 1
        counts = np.zeros(_BINS, np.int64)
        for j in range(current.size):
            counts[(np.int64(current[j]) - lo) >> shift] += 1
        top, seen = (hi - lo) >> shift, 0
        while seen + counts[top] < rank:
            seen += counts[top]
            top -= 1
        if shift == 0:
            return int(lo + top)
        kept, n = np.empty(counts[top], current.dtype), 0
        for j in range(current.size):
            if (np.int64(current[j]) - lo) >> shift == top:
                kept[n] = current[j]
                n += 1
        current, rank = kept, rank - seen
        lo = lo + (top << shift)
        hi = min(hi, lo + (np.int64(1) << shift) - 1)


@_jit
def _tie_cutoff(indices: Array, found: Array, threshold: int, needed: int) -> int:
    """The index after the `needed`-th entry equal to threshold (entries in flat order)."""
    seen = 0
    for j in range(found.size):
        seen += 1 if found[j] == threshold else 0
        if seen == needed:
            return int(indices[j]) + 1
    raise AssertionError("fewer tied entries than needed")


@intrinsic
def _cttz(typingctx: Any, word: Any) -> Any:
    """The number of zero bits below the lowest set bit of a uint64 (which is not 0)."""
    signature = types.uint64(types.uint64)

    def codegen(context: Any, builder: Any, sig: Any, args: Any) -> Any:
        return builder.cttz(args[0], ir.Constant(ir.IntType(1), 1))

    return signature, codegen


_trailing_zeros = cast(Callable[[Any], Any], _cttz)  # as compiled code calls it
_BLOCK = 1024  # elements compared, then collected, at a time (a multiple of 8)


@_jit
def _collect(
    model: Array, base: Array, low: int, high: int, first: int, indices: Array, found: Array,
    counts: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """Count the |model − base| above `high` (counts[0]); collect the flat index (`first` is
    element 0's) and bit pattern of those in [low, high], as many as the buffers hold, and
    count them all (counts[1]).

    A block at a time: a loop without branches (it vectorises) compares every element and
    flags those in the bounds with a byte each; then the flags are read eight at a time, and
    only the set ones are visited. A few % of the elements are, at random places: a loop that
    branched on each (or wrote each) took ten times as long."""
    bits = np.empty(_BLOCK, np.uint32)
    flags = np.zeros(_BLOCK, np.uint8)
    words = flags.view(np.uint64)
    above, between, room = 0, 0, indices.size
    for start in range(lo, hi, _BLOCK):
        width = min(_BLOCK, hi - start)
        block_model, block_base = model[start : start + width], base[start : start + width]
        block_above, block_between = 0, 0
        for q in range(width):
            delta = np.float32(as_float32(block_model[q]) - as_float32(block_base[q]))
            pattern = np.float32(abs(delta)).view(np.uint32)
            bits[q] = pattern
            block_above += 1 if pattern > high else 0
            flag = 1 if (pattern >= low) & (pattern <= high) else 0
            flags[q] = flag
            block_between += flag
        flags[width:] = 0
        above += block_above
        if block_between:
            for w in range((width + 7) // 8):
                word = words[w]
                while word:
                    q = w * 8 + _trailing_zeros(word) // 8
                    if between < room:
                        indices[between], found[between] = first + start + q, bits[q]
                    between += 1
                    word &= word - np.uint64(1)
    counts[0], counts[1] = above, between


# -- the driver -----------------------------------------------------------------------------------
class Selection:
    def __init__(self, *, check_cancel: Callable[[], None]) -> None:
        # Raises when the merge is canceled; called per chunk of every pass.
        self.check_cancel = check_cancel
        # per slice: collected indices and bit patterns, reused (fresh memory page-faults)
        self._collected: list[tuple[Array, Array]] = []

    def select(self, numel: int, k: int, step: int, delta_inputs: DeltaInputs) -> tuple[int, int]:
        """(bit pattern of the k-th largest |model − base|, index after the last tied entry
        kept), reading `step` elements at a time: a tensor of one step is sampled first, and
        its |δ| kept between the radix select's passes; several steps are read again for
        each pass."""
        if step >= numel:
            low, high = _sample_bounds(*delta_inputs(0, numel), k)
            room = numel if (low, high) == (0, _ALL) else numel // _COLLECTED
            found = self._between(numel, k, step, delta_inputs, low, high, room)
            if found is not None:
                return found
        return self._radix(numel, k, step, delta_inputs)

    def _between(
        self, numel: int, k: int, step: int, delta_inputs: DeltaInputs, low: int, high: int,
        room: int,
    ) -> tuple[int, int] | None:  # fmt: skip
        """The answer from one pass that collects the |δ| in [low, high], or None when the
        k-th largest is not among them or more than `room` are."""
        above, parts = 0, []
        for start in range(0, numel, step):
            self.check_cancel()
            count = min(step, numel - start)
            model, base = delta_inputs(start, count)
            slices = THREADS if count >= MIN_SPLIT else 1
            bounds = [count * s // slices for s in range(slices + 1)]
            buffers = [
                (*self._buffers(s, min(room, hi - lo)), np.zeros(2, np.int64), lo, hi)
                for s, (lo, hi) in enumerate(itertools.pairwise(bounds))
            ]
            side_by_side(
                [
                    functools.partial(_collect, model, base, low, high, start, *buffer)
                    for buffer in buffers
                ]
            )
            for indices, found, counts, _, _ in buffers:
                above += int(counts[0])
                room -= int(counts[1])
                if room < 0:
                    return None
                parts.append((indices[: counts[1]].copy(), found[: counts[1]].copy()))
        indices = np.concatenate([p[0] for p in parts])
        found = np.concatenate([p[1] for p in parts])
        return _pick(k - above, indices, found)

    def _buffers(self, slice_: int, size: int) -> tuple[Array, Array]:
        """The `slice_`-th slice's buffers for collected entries, at least `size` long."""
        while len(self._collected) <= slice_:
            self._collected.append((np.empty(0, np.int64), np.empty(0, np.uint32)))
        indices, found = self._collected[slice_]
        if indices.size < size:
            indices, found = np.empty(size, np.int64), np.empty(size, np.uint32)
            self._collected[slice_] = indices, found
        return indices[:size], found[:size]

    def _radix(self, numel: int, k: int, step: int, delta_inputs: DeltaInputs) -> tuple[int, int]:
        """Exact: a histogram of the upper halves of the bit patterns finds the k-th largest's
        bin; then the bin's entries are collected, or for a full bin, histogrammed again by
        their lower halves and scanned for the tied ones."""
        high_counts = np.zeros((THREADS, _BINS), np.int64)

        def passes() -> Iterator[tuple[int, Array]]:  # (first index, |δ| bits) per step
            for start in range(0, numel, step):
                self.check_cancel()
                count = min(step, numel - start)
                model, base = delta_inputs(start, count)
                bits = np.empty(count, np.uint32)
                parallel(_abs_delta_bits, count, model, base, bits, per_slice=high_counts)
                yield start, bits

        kept = list(passes()) if step >= numel else None
        if kept is None:
            for _ in passes():  # the histogram of |δ|'s upper halves
                pass
        counts = high_counts.sum(axis=0)
        high, above_high, remaining = _pick_bin(counts, k)
        if kept is None and counts[high] <= numel // _COLLECTED:  # read again, collecting
            low = high << 16
            found = self._between(numel, k, step, delta_inputs, low, low | 0xFFFF, counts[high])
            assert found is not None
            return found

        def again() -> Iterator[tuple[int, Array]]:
            return iter(kept) if kept is not None else passes()

        low_counts = np.zeros((THREADS, _BINS), np.int64)
        for _, bits in again():
            parallel(_low_histogram, bits.size, bits, high, per_slice=low_counts)
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


def _sample_bounds(model: Array, base: Array, k: int) -> tuple[int, int]:
    """Bit patterns that bound the k-th largest |model − base| from below and above, very
    likely: quantiles of a fixed sample of |δ|, three standard deviations to either side of the
    k-th largest's expected rank in it (a tensor of up to 4 samples is bounded by everything)."""
    numel = model.size
    if numel <= 4 * _SAMPLE:
        return 0, _ALL
    positions = np.arange(_SAMPLE, dtype=np.int64) * _SPREAD % numel
    widened = [_widened(values[positions]) for values in (model, base)]
    sample = np.abs(widened[0] - widened[1]).view(np.uint32)
    below = (numel - k) / numel  # share of |δ| below the k-th largest
    rank = below * _SAMPLE
    margin = 3 * math.sqrt(_SAMPLE * below * (1 - below)) + 16
    low_rank, high_rank = math.floor(rank - margin), math.ceil(rank + margin)  # from below
    low = int(_kth_largest(sample, _SAMPLE - low_rank)) if low_rank > 0 else 0
    high = int(_kth_largest(sample, _SAMPLE - high_rank)) if high_rank < _SAMPLE else _ALL
    return low, high


def _widened(values: Array) -> Array:
    """float32 values of BF16 bit patterns (uint16) or of float32 ones, as the kernels widen."""
    if values.dtype == np.uint16:
        return (values.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return values.astype(np.float32, copy=False)


def _pick(rank: int, indices: Array, found: Array) -> tuple[int, int] | None:
    """Among the collected bit patterns (in flat order), the `rank`-th largest and the index
    after the last tied entry kept; None when there are fewer than `rank` (or rank ≤ 0: the
    k-th largest is above them)."""
    if not 0 < rank <= found.size:
        return None
    threshold = int(_kth_largest(found, rank))
    needed = rank - int(np.count_nonzero(found > threshold))
    return threshold, _tie_cutoff(indices, found, threshold, needed)


def _pick_bin(counts: Array, k: int) -> tuple[int, int, int]:
    """(bin holding the k-th largest, entries in higher bins, k's rank inside that bin)."""
    from_top = np.cumsum(counts[::-1])
    position = int(np.searchsorted(from_top, k))
    above = int(from_top[position - 1]) if position > 0 else 0
    return _BINS - 1 - position, above, k - above
