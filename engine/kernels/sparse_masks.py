"""Which entries of each delta the sparsifying methods keep: a 0/1 mask per term, made a chunk
at a time by compiled kernels (the formulas: engine/methods/dare.py, breadcrumbs.py, della.py).

- DARE: Philox bits (random_bits.py) below density·2³².
- Breadcrumbs: ranks [m₁, m₂) of |δ| from the smallest, so two exact order statistics of the
  whole tensor are found first, as ties_kernels finds TIES's k-th largest: two 16-bit radix
  histograms of the float32 bit patterns (ordered like the values, as |δ| ≥ 0), then a scan for
  the tie cutoff. Each entry then decides on its own against two Cuts, so chunks split across
  threads.
- DELLA: per row, each entry's rank by |δ| (a stable radix sort of the row) gives its keep
  probability, and its Philox bits decide.
- TIES (with rescale): the k largest |δ|, of equal ones at the cut the first in flat order,
  found by TIES's own exact selection (ties_selection.py) as a threshold and a cutoff.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numba
import numpy as np

from engine.kernels.float_bits import as_float32
from engine.kernels.input_rows import Array
from engine.kernels.parallel import THREADS, parallel
from engine.kernels.random_bits import SCALE, fill_bits, stream_key
from engine.kernels.ties_selection import Selection
from engine.plan.model import Dropping, TensorPlan

_BINS = 1 << 16
EVERYTHING = 0xFFFFFFFF  # a cut value above every |δ| bit pattern (NaNs included)
Inputs = Callable[[int, int], tuple[Array, Array]]  # (start, count) -> (base, terms)
_jit = numba.njit(nogil=True, cache=True)


def breadcrumb_ranks(numel: int, density: float, gamma: float) -> tuple[int, int]:
    """(m₁, m₂): the ranks [m₁, m₂) of |δ|, counted from the smallest, that are kept."""
    target, top = int(density * numel), int(gamma * numel)
    bottom = max(0, numel - target - top)
    return bottom, bottom + target


@numba.njit(cache=True)
def abs_delta_bits(model: Any, base: Any) -> Any:
    """|model − base| in float32, as its bit pattern (ordered like the value)."""
    delta = np.float32(as_float32(model) - as_float32(base))
    return np.float32(abs(delta)).view(np.uint32)


# -- selection (breadcrumbs) -------------------------------------------------------------------
@_jit
def _delta_bits(model: Array, base: Array, out: Array, histogram: Array, lo: int, hi: int) -> None:
    """|model − base| as float32 bit patterns, counted by their upper 16 bits."""
    # slices indexed from 0 by the loop counter: numba drops its negative-index checks
    model, base, out = model[lo:hi], base[lo:hi], out[lo:hi]
    for j in range(hi - lo):
        bits = abs_delta_bits(model[j], base[j])
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
            parallel(_low_histograms, bits.size, bits, highs, per_slice=low_counts)
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
    model, base, out = model[lo:hi], base[lo:hi], mask[lo:hi]  # see _delta_bits
    start = first + lo
    for j in range(hi - lo):
        bits = abs_delta_bits(model[j], base[j])
        index = start + j
        below_high = bits < high_value or (bits == high_value and index < high_cutoff)
        below_low = bits < low_value or (bits == low_value and index < low_cutoff)
        out[j] = below_high and not below_low


@_jit
def _top_mask(
    model: Array, base: Array, first: int, threshold: int, cutoff: int, mask: Array, lo: int,
    hi: int,
) -> None:  # fmt: skip
    """1 where an entry is among the k largest: |δ| bits above threshold, or equal to it at a
    flat index below cutoff."""
    model, base, out = model[lo:hi], base[lo:hi], mask[lo:hi]  # see _delta_bits
    start = first + lo
    for j in range(hi - lo):
        bits = abs_delta_bits(model[j], base[j])
        out[j] = bits > threshold or (bits == threshold and start + j < cutoff)


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
            keys[j] = abs_delta_bits(model[at + j], base[at + j])
        fill_bits(first + at, k0, k1, bits)
        _rank_order(keys, order, spare_keys, spare_order, counts)
        for rank in range(width):
            spread = np.float32(np.float32(np.float32(rank) / last) * np.float32(2.0)) * epsilon
            p = np.float32(lowest + np.float32(spread))
            j = order[rank]
            mask[at + j] = np.float64(bits[j]) < np.float64(p) * SCALE


# -- droppers: each term's mask, a chunk at a time ----------------------------------------------
class Dropper(Protocol):
    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        """mask[j] = whether entry first + j is kept."""


@dataclass(frozen=True)
class RandomDrop:
    key: tuple[int, int]
    threshold: int  # ⌈density·2³²⌉

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        bits = np.empty(mask.size, np.uint32)
        parallel(_random_mask, mask.size, first, *self.key, self.threshold, bits, mask)


@dataclass(frozen=True)
class CutDrop:
    low: Cut
    high: Cut

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        low, high = self.low, self.high
        parallel(_cut_mask, mask.size, model, base, first, low.value, low.cutoff, high.value,
               high.cutoff, mask)  # fmt: skip


@dataclass(frozen=True)
class TopDrop:
    threshold: int  # the bit pattern of the k-th largest |δ|
    cutoff: int  # the flat index after the last entry equal to it that is kept

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        parallel(_top_mask, mask.size, model, base, first, self.threshold, self.cutoff, mask)


@dataclass(frozen=True)
class MagPrune:
    key: tuple[int, int]
    width: int  # entries per row
    lowest: np.float32  # density − ε
    epsilon: np.float32

    def fill(self, model: Array, base: Array, first: int, mask: Array) -> None:
        rows = mask.size // self.width
        parallel(_magprune_mask, rows, model, base, first, self.width, *self.key, self.lowest,
               self.epsilon, mask, minimum=2)  # fmt: skip


def row_width(tensor: TensorPlan) -> int:
    """DELLA ranks along rows: the last dimension of a matrix; a vector is one row."""
    return tensor.shape[-1] if len(tensor.shape) == 2 else math.prod(tensor.shape)


# -- making a term's dropper -------------------------------------------------------------------
@dataclass(frozen=True)
class DeltaSource:
    """One term's delta over a tensor, as its dropper is made from it."""

    tensor: TensorPlan
    term: int  # the index of the term (the model) in tensor.terms
    seed: int | None
    step: int  # elements per pass (the whole tensor, when it is held in memory)
    inputs: Inputs
    check_cancel: Callable[[], None]

    @property
    def numel(self) -> int:
        return math.prod(self.tensor.shape)

    def key(self) -> tuple[int, int]:
        assert self.seed is not None
        return stream_key(self.seed, self.tensor.name, self.term)

    def bits(self, counts: Array) -> Iterator[tuple[int, Array]]:
        """(first index, |δ| bit patterns) a step at a time, their upper halves counted."""
        for start in range(0, self.numel, self.step):
            self.check_cancel()
            count = min(self.step, self.numel - start)
            base, terms = self.inputs(start, count)
            bits = np.empty(count, np.uint32)
            parallel(_delta_bits, count, terms[self.term], base, bits, per_slice=counts)
            yield start, bits


def random_drop(source: DeltaSource) -> RandomDrop:
    assert source.tensor.thinning is not None
    density = source.tensor.thinning.densities[source.term]
    return RandomDrop(source.key(), math.ceil(density * SCALE))


def cut_drop(source: DeltaSource) -> CutDrop:
    """Breadcrumbs' two Cuts of the term's |δ|: a pass for the histogram of the upper halves,
    then the selection's passes (over |δ| kept from the first when the tensor is in memory)."""
    thinning = source.tensor.thinning
    assert thinning is not None
    numel = source.numel
    low, high = breadcrumb_ranks(
        numel, thinning.densities[source.term], thinning.gammas[source.term]
    )
    high_counts = np.zeros((THREADS, _BINS), np.int64)
    kept = list(source.bits(high_counts)) if source.step >= numel else None
    if kept is None:
        for _ in source.bits(high_counts):
            pass
    scratch = np.zeros_like(high_counts)

    def again() -> Iterator[tuple[int, Array]]:
        return iter(kept) if kept is not None else source.bits(scratch)

    cut_low, cut_high = smallest_cuts(again, high_counts.sum(axis=0), numel, [low, high])
    return CutDrop(cut_low, cut_high)


def top_drop(source: DeltaSource) -> TopDrop:
    """TIES's k = ⌊density·n⌋ largest |δ| (at least one; TiesSettings.kept), selected exactly
    as TIES's own kernels select them."""
    thinning = source.tensor.thinning
    assert thinning is not None
    numel = source.numel
    k = max(1, int(thinning.densities[source.term] * numel))

    def delta_inputs(start: int, count: int) -> tuple[Array, Array]:
        base, terms = source.inputs(start, count)
        return terms[source.term], base

    selection = Selection(check_cancel=source.check_cancel)
    return TopDrop(*selection.select(numel, k, source.step, delta_inputs))


def mag_prune(source: DeltaSource) -> MagPrune:
    thinning = source.tensor.thinning
    assert thinning is not None
    density, epsilon = thinning.densities[source.term], thinning.epsilons[source.term]
    return MagPrune(
        source.key(), row_width(source.tensor), np.float32(density - epsilon), np.float32(epsilon)
    )


DROPPERS: dict[Dropping, Callable[[DeltaSource], Dropper]] = {
    "random": random_drop,
    "outliers": cut_drop,
    "magprune": mag_prune,
    "magnitude": top_drop,
}
