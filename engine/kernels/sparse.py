"""The sparsifying methods (DARE, breadcrumbs, DELLA; TIES with rescale) on the CPU, compiled
with numba.

Per tensor (the formulas: engine/methods/sparsify.py):

- **What each delta keeps**: a 0/1 mask per term, made a chunk at a time (sparse_masks.py).
- **Rescale** needs ‖δ‖₁ and ‖kept‖₁ of the whole tensor before its first output byte; they are
  summed exactly (exact_sums.py), so they do not depend on chunks or threads.
- **Combination** is one fused loop per element over all terms, in mergekit's order of float32
  operations: thin, rescale, weigh; sum from zero in term order; elect, sum the agreeing terms
  and their weights from zero; divide; scale by λ; add to the base; round once to the output
  dtype (nearest-even; a BF16 NaN as the canonical quiet NaN).

The bytes equal sparse_torch.py's (the torch path, for CUDA and float64) bit for bit.
A tensor of up to `in_memory` elements that needs a pass before its output (a selection or
rescale) is read once and kept, with its masks, between the passes; a larger one (embeddings)
is read again for each. Compiled code is cached on disk (numba's `cache=True`): the first merge
of an installation compiles for some seconds; later processes load it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numba
import numpy as np

from engine.io.memory import keep_freed_memory
from engine.kernels.exact_sums import FLOAT32, rescale_factor, rounded_sum
from engine.kernels.float_bits import as_float32, store
from engine.kernels.input_rows import Array, InputRows, readable
from engine.kernels.parallel import THREADS, parallel
from engine.kernels.sparse_masks import DROPPERS, DeltaSource, Dropper, Inputs, row_width
from engine.plan.model import Plan, SparsifySettings, TensorPlan

_SUM_BINS = FLOAT32.bins
_BLOCK = 512  # elements per inner loop of the combination: its rows stay in the L1 cache
_jit = numba.njit(nogil=True, cache=True)


def handles(plan: Plan, device: str) -> bool:
    """Whether this module computes every tensor a sparsifying plan does not copy."""
    if device != "cpu" or plan.sparsify is None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op != "sparsify" or not readable(plan, tensor, plan.inputs_read(tensor)):
            return False
        if plan.sparsify.dropping == "magprune" and len(tensor.shape) > 2:
            return False  # its ranks run along dim 1 of a 3-D block: the torch path has them
    return True


# -- sums and the combination ------------------------------------------------------------------
@numba.njit(cache=True)
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
        delta = np.float32(as_float32(model[j]) - as_float32(base[j]))
        lane = j & (_LANES - 1)
        _count(bins[0, lane], abs(delta))
        _count(bins[1, lane], abs(np.float32(delta * np.float32(mask[j]))))


@numba.njit(cache=True)
def _agreeing(
    weighted: Array, weights: Array, total: Array, mixed: Array, agreeing: Array, width: int
) -> None:
    """mixed[:width] = the sum of the weighted deltas whose sign is the total's (zero counts as
    +, NaN as −), agreeing[:width] = the sum of their weights (one where none agrees)."""
    zero, one = np.float32(0.0), np.float32(1.0)
    for q in range(width):
        mixed[q], agreeing[q] = zero, zero
    for i in range(weighted.shape[0]):
        d, c = weighted[i], weights[i]
        for q in range(width):
            up = total[q] >= zero
            agree = one if (d[q] > zero if up else d[q] < zero) else zero
            mixed[q] = np.float32(mixed[q] + np.float32(d[q] * agree))
            agreeing[q] = np.float32(agreeing[q] + np.float32(c * agree))
    for q in range(width):
        agreeing[q] = one if agreeing[q] == zero else agreeing[q]


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
            b[q], total[q] = as_float32(block_base[q]), zero
        for i in range(count):
            row, keep = terms[i, start : start + width], masks[i, start : start + width]
            d, scale, c = weighted[i], scales[i], weights[i]
            if thinned[i]:
                for q in range(width):
                    delta = np.float32(as_float32(row[q]) - b[q]) * np.float32(keep[q])
                    d[q] = np.float32(np.float32(delta * scale) * c)
                    total[q] = np.float32(total[q] + d[q])
            else:
                for q in range(width):
                    d[q] = np.float32(np.float32(as_float32(row[q]) - b[q]) * c)
                    total[q] = np.float32(total[q] + d[q])
        if consensus:
            _agreeing(weighted, weights, total, mixed, agreeing, width)
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
            store(block_out, q, total[q])


# -- the driver ---------------------------------------------------------------------------------
@dataclass
class _Work:
    """One tensor's chunk sources, droppers, masks held (if any) and rescale factors."""

    step: int
    inputs: Inputs
    droppers: list[Dropper | None]
    thinned: Array  # per term: whether anything is dropped
    kept: Array | None = None  # every term's mask of the whole tensor, when it is held
    scales: Array = field(init=False)  # per term: ‖δ‖₁ / ‖kept‖₁ with rescale, else 1

    def __post_init__(self) -> None:
        self.scales = np.ones(len(self.droppers), np.float32)

    def masks(self, start: int, base: Array, terms: Array) -> Array:
        """The masks of the elements from `start` that `base` and `terms` hold."""
        if self.kept is not None:
            return self.kept[:, start : start + base.size]
        return _masks(self.droppers, base, terms, start)


def _masks(droppers: list[Dropper | None], base: Array, terms: Array, start: int) -> Array:
    masks = np.ones((len(droppers), base.size), np.uint8)
    for i, dropper in enumerate(droppers):
        if dropper is not None:
            dropper.fill(terms[i], base, start, masks[i])
    return masks


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
        self._rows = InputRows(plan)
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
        numel, settings = math.prod(tensor.shape), self.settings
        work = self._prepare(tensor)
        weights = np.array([t.coefficient for t in tensor.terms], np.float32)
        divisor = np.float32(0.0)
        for w in weights:  # Σ wᵢ from zero in term order, as torch sums them
            divisor = np.float32(divisor + w)
        divisor = np.float32(1.0) if abs(divisor) < np.float32(1e-8) else divisor
        lambda_ = np.float32(tensor.thinning.lambda_)
        for start in range(0, numel, work.step):
            self.check_cancel()
            count = min(work.step, numel - start)
            base, terms = work.inputs(start, count)
            out = np.empty(count, np.uint16 if tensor.dtype == "BF16" else np.float32)
            parallel(
                _combine, count, base, terms, work.masks(start, base, terms), work.thinned,
                work.scales, weights, settings.consensus, settings.normalize, divisor, lambda_,
                out,
            )  # fmt: skip
            if tensor.dtype == "F16":
                out = out.astype(np.float16)  # round to nearest-even, as torch does
            data = out.view(np.uint8).data
            piece = self.chunk_elements * out.itemsize  # the writer's unit of buffering
            for at in range(0, len(data), piece):
                yield data[at : at + piece]

    def _prepare(self, tensor: TensorPlan) -> _Work:
        """What the tensor's chunks need: its droppers (breadcrumbs' selection passes run
        here), its inputs and masks (held when a pass precedes the output and it fits), the
        rescale factors."""
        assert tensor.thinning is not None
        numel, settings = math.prod(tensor.shape), self.settings
        thinned = np.array([d < 1.0 for d in tensor.thinning.densities])
        selects = settings.dropping in ("outliers", "magnitude")
        ahead = thinned.any() and (selects or settings.rescale)
        whole = self._inputs(tensor, 0, numel) if ahead and numel <= self.in_memory else None
        step = max(1, numel) if whole is not None else self._step(tensor)

        def inputs(start: int, count: int) -> tuple[Array, Array]:
            if whole is None:
                return self._inputs(tensor, start, count)
            return whole[0][start : start + count], whole[1][:, start : start + count]

        droppers = [
            DROPPERS[settings.dropping](
                DeltaSource(tensor, i, settings.seed, step, inputs, self.check_cancel)
            )
            if thin
            else None
            for i, thin in enumerate(thinned)
        ]
        work = _Work(step, inputs, droppers, thinned)
        if whole is not None:
            work.kept = _masks(droppers, whole[0], whole[1], 0)
        if settings.rescale and thinned.any():
            work.scales = self._scales(work, numel)
        return work

    def _step(self, tensor: TensorPlan) -> int:
        """Elements per chunk: whole rows for DELLA, whose ranks run along them."""
        if self.settings.dropping != "magprune":
            return self.chunk_elements
        width = row_width(tensor)
        return max(1, self.chunk_elements // width) * width

    def _scales(self, work: _Work, numel: int) -> Array:
        """Per term: ‖δ‖₁ / ‖kept‖₁ (1 where nothing is dropped or a norm is ~0)."""
        droppers = work.droppers
        bins = np.zeros((len(droppers), THREADS, 2, _LANES, _SUM_BINS), np.int64)
        for start in range(0, numel, work.step):
            self.check_cancel()
            count = min(work.step, numel - start)
            base, terms = work.inputs(start, count)
            kept = work.masks(start, base, terms)
            for i, dropper in enumerate(droppers):
                if dropper is not None:
                    parallel(_l1_bins, count, terms[i], base, kept[i], per_slice=bins[i])
        scales = np.ones(len(droppers), np.float32)
        for i, dropper in enumerate(droppers):
            if dropper is not None:
                full, kept_sum = (
                    rounded_sum(b.tolist(), FLOAT32) for b in bins[i].sum(axis=(0, 2))
                )
                scales[i] = rescale_factor(full, kept_sum, FLOAT32)
        return scales

    # -- reading ------------------------------------------------------------------------------
    def _inputs(self, tensor: TensorPlan, start: int, count: int) -> tuple[Array, Array]:
        """The base's elements and every term's (input_rows.py)."""
        sources = [self.settings.base, *(t.source for t in tensor.terms)]
        rows = self._rows.read(tensor, sources, start, count)
        return rows[0], rows[1:]
