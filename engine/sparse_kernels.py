"""The sparsifying methods (DARE, breadcrumbs, DELLA) on the CPU, compiled with numba.

Per tensor (the formulas: engine/methods/sparsify.py):

- **What each delta keeps** is a 0/1 mask per term, made a chunk at a time: DARE's from Philox
  bits (random_bits.py) against the density; breadcrumbs' from two exact order statistics of
  |δ| found first (radix selection on float32 bit patterns, counted from the smallest: every
  entry decides on its own against a value and a tie cutoff, so chunks split across threads);
  DELLA's per row, from each entry's rank by |δ| (a radix sort of the row) and Philox bits.
- **Rescale** needs ‖δ‖₁ and ‖kept‖₁ of the whole tensor before its first output byte; they are
  summed exactly (exact_sums.py), so they do not depend on chunks or threads.
- **Combination** is one fused loop per element over all terms, in mergekit's order of float32
  operations: thin, rescale, weigh; sum from zero in term order; elect, sum the agreeing terms
  and their weights from zero; divide; scale by λ; add to the base; round once to the output
  dtype (nearest-even; a BF16 NaN as the canonical quiet NaN).

The bytes equal sparse_torch.py's (the torch path, for CUDA and float64) bit for bit.
A tensor of up to `in_memory` elements that needs a pass before its output (a selection or
rescale) is read once and kept, with its masks, between the passes; a larger one (embeddings)
is read again for each. Compiled code is cached on disk (numba's `cache=True`).
"""

from __future__ import annotations

import functools
import math
import os
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import numba
import numpy as np
import numpy.typing as npt
from numba import types
from numba.extending import overload

from engine.exact_sums import FLOAT32, rescale_factor, rounded_sum
from engine.memory import keep_freed_memory
from engine.methods.breadcrumbs import breadcrumb_ranks
from engine.plan import Dropping, Plan, SparsifySettings, TensorPlan
from engine.random_bits import SCALE, fill_bits, stream_key

SUPPORTED_DTYPES = frozenset({"BF16", "F16", "F32"})
THREADS = max(1, min(4, os.cpu_count() or 1))
_MIN_SPLIT = 1 << 16  # below this many elements one thread does it all
_BINS = 1 << 16
_SUM_BINS = FLOAT32.bins
_BLOCK = 512  # elements per inner loop of the combination: its rows stay in the L1 cache
EVERYTHING = 0xFFFFFFFF  # a cut value above every |δ| bit pattern (NaNs included)

Array = npt.NDArray[Any]
Inputs = Callable[[int, int], tuple[Array, Array]]  # (start, count) -> (base, terms)
_jit = numba.njit(nogil=True, cache=True)


def handles(plan: Plan, device: str) -> bool:
    """Whether this module computes every tensor a sparsifying plan does not copy."""
    if device != "cpu" or plan.sparsify is None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op != "sparsify" or tensor.dtype not in SUPPORTED_DTYPES:
            return False
        dtypes = {plan.checkpoints[s].tensors[tensor.read_name].dtype for s in plan.reads(tensor)}
        if len(dtypes) != 1 or not dtypes <= SUPPORTED_DTYPES:  # one (validate.py checks it)
            return False
        if plan.sparsify.dropping == "magprune" and len(tensor.shape) > 2:
            return False  # its ranks run along dim 1 of a 3-D block: the torch path has them
    return True


# -- element access ----------------------------------------------------------------------------
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


def _store(out: Any, j: int, value: Any) -> None:
    raise NotImplementedError  # only called from compiled code


@overload(_store, inline="always")
def _store_impl(out: Any, j: Any, value: Any) -> Any:
    """Into a BF16 output (uint16 bits): round to nearest-even, NaN as the canonical quiet NaN;
    into a float32 one: as is."""
    if isinstance(out.dtype, types.Integer):

        def to_bf16(out: Any, j: Any, value: Any) -> Any:
            bits = np.float32(value).view(np.uint32)
            half = ((bits >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)
            rounded = np.uint16(np.uint32(bits + half) >> np.uint32(16))
            out[j] = rounded if value == value else np.uint16(0x7FC0)

        return to_bf16

    def as_is(out: Any, j: Any, value: Any) -> Any:
        out[j] = value

    return as_is


@numba.njit(inline="always", cache=True)
def _abs_delta_bits(model: Any, base: Any) -> Any:
    delta = np.float32(_as_float32(model) - _as_float32(base))
    return np.float32(abs(delta)).view(np.uint32)


# -- selection (breadcrumbs) -------------------------------------------------------------------
@_jit
def _delta_bits(model: Array, base: Array, out: Array, histogram: Array, lo: int, hi: int) -> None:
    """|model − base| as float32 bit patterns, counted by their upper 16 bits."""
    model, base, out = model[lo:hi], base[lo:hi], out[lo:hi]  # see _combine
    for j in range(hi - lo):
        bits = _abs_delta_bits(model[j], base[j])
        out[j] = bits
        histogram[bits >> np.uint32(16)] += 1


@_jit
def _low_histograms(bits: Array, highs: Array, histograms: Array, lo: int, hi: int) -> None:
    """For each upper half in `highs`, the lower halves of the patterns that have it."""
    bits = bits[lo:hi]
    for j in range(hi - lo):
        high = bits[j] >> np.uint32(16)
        for h in range(highs.size):
            if high == highs[h]:
                histograms[h, bits[j] & np.uint32(0xFFFF)] += 1


@_jit
def _find_tie(bits: Array, value: int, needed: int) -> tuple[int, int]:
    """(index after the `needed`-th entry equal to value, or -1; how many were seen)."""
    seen = 0
    for j in range(bits.size):
        if bits[j] == value:
            seen += 1
            if seen == needed:
                return j + 1, seen
    return -1, seen


@dataclass(frozen=True)
class Cut:
    """The m smallest entries (equal ones in flat order): those whose |δ| bits are below
    `value`, or equal to it at a flat index below `cutoff`."""

    value: int
    cutoff: int


def _pick_bin(counts: Array, rank: int) -> tuple[int, int]:
    """(bin holding the rank-th smallest entry, 1-based; entries in lower bins)."""
    cumulative = np.cumsum(counts)
    position = int(np.searchsorted(cumulative, rank))
    return position, int(cumulative[position - 1]) if position > 0 else 0


def smallest_cuts(
    passes: Callable[[], Iterator[tuple[int, Array]]], high_counts: Array, numel: int,
    ranks: list[int],
) -> list[Cut]:  # fmt: skip
    """A Cut for each m in `ranks`. `high_counts` is the histogram of the upper halves of |δ|
    bits; `passes()` yields (first index, |δ| bits) over the tensor, again for each pass."""
    cuts: dict[int, Cut] = {0: Cut(0, 0), numel: Cut(EVERYTHING, 0)}
    wanted = sorted({m for m in ranks if m not in cuts})
    if wanted:
        in_bins = [(m, *_pick_bin(high_counts, m)) for m in wanted]  # (m, high, below high)
        highs = np.array(sorted({high for _, high, _ in in_bins}), np.uint32)
        low_counts = np.zeros((THREADS, highs.size, _BINS), np.int64)
        for _, bits in passes():
            _split(_low_histograms, bits.size, bits, highs, per_slice=low_counts)
        lows = low_counts.sum(axis=0)
        ties: list[tuple[int, int, int]] = []  # (m, value, entries equal to value it includes)
        for m, high, below_high in in_bins:
            low, below_low = _pick_bin(lows[int(np.searchsorted(highs, high))], m - below_high)
            ties.append((m, (high << 16) | low, m - below_high - below_low))
        for m, value, needed in ties:
            cuts[m] = Cut(value, _tie_cutoff(passes, value, needed))
    return [cuts[m] for m in ranks]


def _tie_cutoff(passes: Callable[[], Iterator[tuple[int, Array]]], value: int, needed: int) -> int:
    for start, bits in passes():
        cutoff, seen = _find_tie(bits, value, needed)
        if cutoff >= 0:
            return start + cutoff
        needed -= seen
    raise AssertionError("an order statistic of |δ| was not found again")


# -- masks -------------------------------------------------------------------------------------
@_jit
def _cut_mask(
    model: Array, base: Array, first: int, low_value: int, low_cutoff: int, high_value: int,
    high_cutoff: int, mask: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """1 where an entry is among the m₂ smallest but not among the m₁ smallest (two Cuts)."""
    model, base, out = model[lo:hi], base[lo:hi], mask[lo:hi]  # see _combine
    start = first + lo
    for j in range(hi - lo):
        bits = _abs_delta_bits(model[j], base[j])
        index = start + j
        below_high = bits < high_value or (bits == high_value and index < high_cutoff)
        below_low = bits < low_value or (bits == low_value and index < low_cutoff)
        out[j] = below_high and not below_low


@_jit
def _random_mask(
    first: int, k0: int, k1: int, threshold: int, bits: Array, mask: Array, lo: int, hi: int
) -> None:
    """1 where an entry's Philox bits are below threshold (= ⌈p·2³²⌉)."""
    bits, out = bits[lo:hi], mask[lo:hi]
    fill_bits(first + lo, k0, k1, bits)
    for j in range(hi - lo):
        out[j] = np.int64(bits[j]) < threshold


@_jit
def _rank_order(keys: Array, order: Array, spare_keys: Array, spare_order: Array,
                counts: Array) -> None:  # fmt: skip
    """order[r] = the index of the r-th smallest key, equal keys in index order: a stable LSD
    radix sort, 8 bits a pass, skipping passes whose digit every key shares. Clobbers keys."""
    m = keys.size
    counts[:, :] = 0
    for j in range(m):
        k = keys[j]
        for d in range(4):
            counts[d, (k >> np.uint32(8 * d)) & np.uint32(255)] += 1
        order[j] = j
    source_keys, source_order, target_keys, target_order = keys, order, spare_keys, spare_order
    for d in range(4):
        shift = np.uint32(8 * d)
        if counts[d, (source_keys[0] >> shift) & np.uint32(255)] == m:
            continue
        total = 0
        for v in range(256):
            counts[d, v], total = total, total + counts[d, v]
        for j in range(m):
            k = source_keys[j]
            digit = (k >> shift) & np.uint32(255)
            at = counts[d, digit]
            counts[d, digit] = at + 1
            target_keys[at], target_order[at] = k, source_order[j]
        source_keys, target_keys = target_keys, source_keys
        source_order, target_order = target_order, source_order
    if source_order is not order:
        order[:] = source_order


@_jit
def _magprune_mask(
    model: Array, base: Array, first: int, width: int, k0: int, k1: int, lowest: Any,
    epsilon: Any, mask: Array, row_lo: int, row_hi: int,
) -> None:  # fmt: skip
    """Rows [row_lo, row_hi) of `width` entries: 1 where an entry's Philox bits are below its
    keep probability p = lowest + 2ε·r/(width − 1), r its rank by |δ| in the row, in float32
    as mergekit computes it."""
    keys, spare_keys = np.empty(width, np.uint32), np.empty(width, np.uint32)
    order, spare_order = np.empty(width, np.int64), np.empty(width, np.int64)
    bits, counts = np.empty(width, np.uint32), np.empty((4, 256), np.int64)
    last = np.float32(max(width - 1, 1))
    for row in range(row_lo, row_hi):
        at = row * width
        for j in range(width):
            keys[j] = _abs_delta_bits(model[at + j], base[at + j])
        fill_bits(first + at, k0, k1, bits)
        _rank_order(keys, order, spare_keys, spare_order, counts)
        for rank in range(width):
            spread = np.float32(np.float32(np.float32(rank) / last) * np.float32(2.0)) * epsilon
            p = np.float32(lowest + np.float32(spread))
            j = order[rank]
            mask[at + j] = np.float64(bits[j]) < np.float64(p) * SCALE


# -- sums and the combination ------------------------------------------------------------------
@numba.njit(inline="always", cache=True)
def _count(bins: Any, magnitude: Any) -> None:
    bits = np.float32(magnitude).view(np.uint32)
    exponent, fraction = bits >> np.uint32(23), bits & np.uint32(0x7FFFFF)
    if exponent == 255:
        bins[255 if fraction == 0 else 256] += 1
    else:
        bins[exponent] += fraction | (np.uint32(exponent != 0) << np.uint32(23))


_LANES = 4  # copies of the bins, taken in turn: neighbours (often of one exponent) do not wait
# for each other's increment


@_jit
def _l1_bins(model: Array, base: Array, mask: Array, bins: Array, lo: int, hi: int) -> None:
    """Exact-sum bins (exact_sums.py) of |δ| (bins[0]) and of |δ·mask| (bins[1]), each in
    _LANES copies."""
    model, base, mask = model[lo:hi], base[lo:hi], mask[lo:hi]
    for j in range(hi - lo):
        delta = np.float32(_as_float32(model[j]) - _as_float32(base[j]))
        lane = j & (_LANES - 1)
        _count(bins[0, lane], abs(delta))
        _count(bins[1, lane], abs(np.float32(delta * np.float32(mask[j]))))


@_jit
def _combine(
    base: Array, terms: Array, masks: Array, thinned: Array, scales: Array, weights: Array,
    consensus: bool, normalize: bool, divisor: Any, lambda_: Any, out: Array, lo: int, hi: int,
) -> None:  # fmt: skip
    """base + λ·merge(wᵢ·scaleᵢ·maskᵢ·δᵢ) over elements [lo, hi), block by block; every loop
    runs over the elements of a block, term by term, so that it vectorises."""
    zero, one = np.float32(0.0), np.float32(1.0)
    count = terms.shape[0]
    b, total = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32)
    mixed, agreeing = np.empty(_BLOCK, np.float32), np.empty(_BLOCK, np.float32)
    weighted = np.empty((count, _BLOCK), np.float32)
    for start in range(lo, hi, _BLOCK):
        width = min(_BLOCK, hi - start)
        # slices, indexed from 0 by the loop counter: numba then drops its negative-index
        # checks and the loops vectorise
        block_base, block_out = base[start : start + width], out[start : start + width]
        for q in range(width):
            b[q], total[q] = _as_float32(block_base[q]), zero
        for i in range(count):
            row, keep = terms[i, start : start + width], masks[i, start : start + width]
            d, scale, c = weighted[i], scales[i], weights[i]
            if thinned[i]:
                for q in range(width):
                    delta = np.float32(_as_float32(row[q]) - b[q]) * np.float32(keep[q])
                    d[q] = np.float32(np.float32(delta * scale) * c)
                    total[q] = np.float32(total[q] + d[q])
            else:
                for q in range(width):
                    d[q] = np.float32(np.float32(_as_float32(row[q]) - b[q]) * c)
                    total[q] = np.float32(total[q] + d[q])
        if consensus:  # the terms whose sign is the total's (zero counts as +, NaN as −)
            for q in range(width):
                mixed[q], agreeing[q] = zero, zero
            for i in range(count):
                d, c = weighted[i], weights[i]
                for q in range(width):
                    up = total[q] >= zero
                    agree = one if (d[q] > zero if up else d[q] < zero) else zero
                    mixed[q] = np.float32(mixed[q] + np.float32(d[q] * agree))
                    agreeing[q] = np.float32(agreeing[q] + np.float32(c * agree))
            for q in range(width):
                agreeing[q] = one if agreeing[q] == zero else agreeing[q]
        else:
            for q in range(width):
                mixed[q], agreeing[q] = total[q], divisor
        for q in range(width):
            merged = mixed[q]
            if normalize:
                merged = np.float32(merged / agreeing[q])
            if lambda_ != one:
                merged = np.float32(merged * lambda_)
            total[q] = np.float32(b[q] + merged)
        for q in range(width):  # a loop of its own: it vectorises only alone
            _store(block_out, q, total[q])


# -- the droppers: each term's mask, a chunk at a time -----------------------------------------
class Dropper(Protocol):
    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        """mask[j] = whether entry first + j is kept."""


@dataclass(frozen=True)
class RandomDrop:
    key: tuple[int, int]
    threshold: int  # ⌈density·2³²⌉

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        bits = np.empty(mask.size, np.uint32)
        _split(_random_mask, mask.size, first, *self.key, self.threshold, bits, mask)


@dataclass(frozen=True)
class CutDrop:
    low: Cut
    high: Cut

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        low, high = self.low, self.high
        _split(_cut_mask, mask.size, model, base, first, low.value, low.cutoff, high.value,
               high.cutoff, mask)  # fmt: skip


@dataclass(frozen=True)
class MagPrune:
    key: tuple[int, int]
    width: int  # entries per row
    lowest: np.float32  # density − ε
    epsilon: np.float32

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        rows = mask.size // self.width
        _split(_magprune_mask, rows, model, base, first, self.width, *self.key, self.lowest,
               self.epsilon, mask, minimum=2)  # fmt: skip


def row_width(tensor: TensorPlan) -> int:
    """DELLA ranks along rows: the last dimension of a matrix; a vector is one row."""
    return tensor.shape[-1] if len(tensor.shape) == 2 else math.prod(tensor.shape)


# -- the driver ---------------------------------------------------------------------------------
class SparseKernels:
    def __init__(
        self,
        plan: Plan,
        *,
        chunk_elements: int,
        check_cancel: Callable[[], None] | None = None,
    ) -> None:
        assert plan.sparsify is not None
        self.plan = plan
        self.settings: SparsifySettings = plan.sparsify
        keep_freed_memory()  # chunk buffers are reused, not page-faulted in again
        # Raises when the merge is canceled; called per chunk of the passes that read a whole
        # tensor before its first output byte.
        self.check_cancel = check_cancel or (lambda: None)
        self.chunk_elements = chunk_elements
        self.in_memory = 8 * chunk_elements  # every layer weight at the default chunk size

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        assert tensor.thinning is not None
        numel, settings, thinning = math.prod(tensor.shape), self.settings, tensor.thinning
        thinned = np.array([d < 1.0 for d in thinning.densities])
        ahead = thinned.any() and (settings.dropping == "outliers" or settings.rescale)
        whole = self._inputs(tensor, 0, numel) if ahead and numel <= self.in_memory else None
        step = max(1, numel) if whole is not None else self._step(tensor)

        def inputs(start: int, count: int) -> tuple[Array, Array]:
            if whole is None:
                return self._inputs(tensor, start, count)
            return whole[0][start : start + count], whole[1][:, start : start + count]

        droppers = [
            DROPPERS[settings.dropping](self, tensor, i, step, inputs) if thin else None
            for i, thin in enumerate(thinned)
        ]
        kept = self._masks(droppers, inputs, 0, numel) if whole is not None else None

        def masks(start: int, count: int) -> Array:
            if kept is not None:
                return kept[:, start : start + count]
            return self._masks(droppers, inputs, start, count)

        scales = np.ones(len(droppers), np.float32)
        if settings.rescale and thinned.any():
            scales = self._scales(droppers, numel, step, inputs, masks)
        weights = np.array([t.coefficient for t in tensor.terms], np.float32)
        divisor = np.float32(0.0)
        for w in weights:  # Σ wᵢ from zero in term order, as torch sums them
            divisor = np.float32(divisor + w)
        divisor = np.float32(1.0) if abs(divisor) < np.float32(1e-8) else divisor
        lambda_ = np.float32(thinning.lambda_)
        for start in range(0, numel, step):
            self.check_cancel()
            count = min(step, numel - start)
            base, terms = inputs(start, count)
            out = np.empty(count, np.uint16 if tensor.dtype == "BF16" else np.float32)
            _split(
                _combine, count, base, terms, masks(start, count), thinned, scales, weights,
                settings.consensus, settings.normalize, divisor, lambda_, out,
            )  # fmt: skip
            if tensor.dtype == "F16":
                out = out.astype(np.float16)  # round to nearest-even, as torch does
            data = out.view(np.uint8).data
            piece = self.chunk_elements * out.itemsize  # the writer's unit of buffering
            for at in range(0, len(data), piece):
                yield data[at : at + piece]

    def _step(self, tensor: TensorPlan) -> int:
        """Elements per chunk: whole rows for DELLA, whose ranks run along them."""
        if self.settings.dropping != "magprune":
            return self.chunk_elements
        width = row_width(tensor)
        return max(1, self.chunk_elements // width) * width

    def _masks(self, droppers: list[Dropper | None], inputs: Inputs, start: int,
               count: int) -> Array:  # fmt: skip
        base, terms = inputs(start, count)
        masks = np.ones((len(droppers), count), np.uint8)
        for i, dropper in enumerate(droppers):
            if dropper is not None:
                dropper.fill(terms[i], base, start, masks[i])
        return masks

    def _scales(
        self, droppers: list[Dropper | None], numel: int, step: int, inputs: Inputs,
        masks: Callable[[int, int], Array],
    ) -> Array:  # fmt: skip
        """Per term: ‖δ‖₁ / ‖kept‖₁ (1 where nothing is dropped or a norm is ~0)."""
        bins = np.zeros((len(droppers), THREADS, 2, _LANES, _SUM_BINS), np.int64)
        for start in range(0, numel, step):
            self.check_cancel()
            count = min(step, numel - start)
            base, terms = inputs(start, count)
            kept = masks(start, count)
            for i, dropper in enumerate(droppers):
                if dropper is not None:
                    _split(_l1_bins, count, terms[i], base, kept[i], per_slice=bins[i])
        scales = np.ones(len(droppers), np.float32)
        for i, dropper in enumerate(droppers):
            if dropper is not None:
                full, kept_sum = (
                    rounded_sum(b.tolist(), FLOAT32) for b in bins[i].sum(axis=(0, 2))
                )
                scales[i] = rescale_factor(full, kept_sum, FLOAT32)
        return scales

    def cut_drop(self, tensor: TensorPlan, i: int, step: int, inputs: Inputs) -> CutDrop:
        """Breadcrumbs' two Cuts of term i's |δ|, from its selection passes."""
        assert tensor.thinning is not None
        numel = math.prod(tensor.shape)
        thinning = tensor.thinning
        low, high = breadcrumb_ranks(numel, thinning.densities[i], thinning.gammas[i])

        def passes(counts: Array) -> Iterator[tuple[int, Array]]:  # (first index, |δ| bits)
            for start in range(0, numel, step):
                self.check_cancel()
                count = min(step, numel - start)
                base, terms = inputs(start, count)
                bits = np.empty(count, np.uint32)
                _split(_delta_bits, count, terms[i], base, bits, per_slice=counts)
                yield start, bits

        high_counts = np.zeros((THREADS, _BINS), np.int64)  # of |δ|'s upper halves
        kept = list(passes(high_counts)) if step >= numel else None
        if kept is None:
            for _ in passes(high_counts):
                pass
        scratch = np.zeros_like(high_counts)

        def again() -> Iterator[tuple[int, Array]]:
            return iter(kept) if kept is not None else passes(scratch)

        cut_low, cut_high = smallest_cuts(again, high_counts.sum(axis=0), numel, [low, high])
        return CutDrop(cut_low, cut_high)

    def random_drop(self, tensor: TensorPlan, i: int, step: int, inputs: Inputs) -> RandomDrop:
        assert tensor.thinning is not None
        key = self._key(tensor, i)
        return RandomDrop(key, math.ceil(tensor.thinning.densities[i] * SCALE))

    def mag_prune(self, tensor: TensorPlan, i: int, step: int, inputs: Inputs) -> MagPrune:
        assert tensor.thinning is not None
        density, epsilon = tensor.thinning.densities[i], tensor.thinning.epsilons[i]
        return MagPrune(
            self._key(tensor, i), row_width(tensor), np.float32(density - epsilon),
            np.float32(epsilon),
        )  # fmt: skip

    def _key(self, tensor: TensorPlan, i: int) -> tuple[int, int]:
        assert self.settings.seed is not None
        return stream_key(self.settings.seed, tensor.name, i)

    # -- reading ------------------------------------------------------------------------------
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
            checkpoint = self.plan.checkpoints[source]
            info = checkpoint.tensors[tensor.read_name]
            if info.dtype != "F16":  # the bytes as they are
                checkpoint.read_into(info, row.view(np.uint8).data, start * info.itemsize)
                return
            raw = np.empty(count * info.itemsize, np.uint8)
            checkpoint.read_into(info, raw.data, start * info.itemsize)
            row[:] = raw.view(np.float16)

        _side_by_side(
            [functools.partial(read, s, row) for s, row in zip(sources, rows, strict=True)]
        )
        return rows[0], rows[1:]


# (kernels, tensor, term, step, inputs) -> that term's dropper
DROPPERS: dict[Dropping, Callable[[SparseKernels, TensorPlan, int, int, Inputs], Dropper]] = {
    "random": SparseKernels.random_drop,
    "outliers": SparseKernels.cut_drop,
    "magprune": SparseKernels.mag_prune,
}


# -- threads ------------------------------------------------------------------------------------
def _split(
    kernel: Any, n: int, *args: Any, per_slice: Array | None = None, minimum: int = _MIN_SPLIT
) -> None:
    """Run `kernel(*args, [per_slice[s],] lo, hi)` over [0, n) in up to THREADS slices (the
    kernels release the GIL); `per_slice` gives each slice its own row (a histogram each)."""
    slices = min(THREADS, n) if n >= minimum else 1
    bounds = [n * s // slices for s in range(slices + 1)]
    own = [(per_slice[s],) if per_slice is not None else () for s in range(slices)]
    _side_by_side(
        [functools.partial(kernel, *args, *own[s], bounds[s], bounds[s + 1]) for s in range(slices)]
    )


def _side_by_side(calls: list[Callable[[], None]]) -> None:
    """Run the calls on the caller's thread and the pool's, all at once."""
    futures = [_pool_of(os.getpid()).submit(call) for call in calls[1:]]
    calls[0]()
    for future in futures:
        future.result()


@functools.cache
def _pool_of(pid: int) -> ThreadPoolExecutor:
    """One per process: a forked child (a prefork worker) has none of its parent's threads."""
    return ThreadPoolExecutor(max(1, THREADS - 1), thread_name_prefix="sparse")
