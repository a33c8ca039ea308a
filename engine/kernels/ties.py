"""TIES on the CPU, compiled with numba: each step is one pass over memory on every core.

torch_kernels.Kernels computes TIES with a dozen whole-chunk torch ops per term, gathers |δ| and
partitions it for the top-k, and keeps a running tie quota that forces chunks into order;
on 2 cores that took ~49 ns per parameter of a 1.7B model's layer (this one: ~17). Here:

- **Selection** of the k-th largest |δ| is exact and sort-free (ties_selection.py): usually one
  pass that counts the |δ| above bounds found from a sample and collects those between them.
  The tied entries kept (the first ones in flat order) end at a cutoff index, so each element
  decides on its own and chunks split across threads. A tensor of up to `in_memory` elements
  is read once and held; a larger one (embeddings) is read again for each pass.
- **Combination** is one fused loop per element over all terms.

The arithmetic is torch_kernels.Kernels._ties', bit for bit: float32, coefficients and λ rounded to
float32, sums in term order, one rounding to the output dtype (nearest-even). Only NaN payloads
may differ: a NaN is written as the canonical quiet NaN, as linear_kernels.narrow does.

Compiled code is cached on disk (numba's `cache=True`): the first TIES merge of an installation
compiles for a few seconds; later processes load it.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numba
import numpy as np

from engine.io.memory import keep_freed_memory
from engine.kernels.float_bits import as_float32, store
from engine.kernels.input_rows import Array, InputRows, readable
from engine.kernels.parallel import parallel
from engine.kernels.ties_selection import DeltaInputs, Selection
from engine.plan.model import Plan, TensorPlan, TiesSettings

_BINS = 1 << 16

_jit = numba.njit(nogil=True, cache=True, error_model="numpy")


def handles(plan: Plan, device: str) -> bool:
    """Whether this module computes every tensor a TIES plan does not copy."""
    if device != "cpu" or plan.ties is None or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        sources = {t.source for t in tensor.terms} | {plan.ties.base}
        if tensor.op != "ties" or not readable(plan, tensor, sources):
            return False
    return True


# -- the compiled kernel: works on elements [lo, hi) so that threads can split the work -------
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
            b[q] = as_float32(block_base[q])
            positive[q], negative[q], up[q], down[q] = zero, zero, zero, zero
        for i in range(terms.shape[0]):
            row, c, threshold = terms[i][start : start + width], coefficients[i], thresholds[i]
            # the tied entries before it are kept; without trimming, everything is
            ties_end = cutoffs[i] - first - start if trim else width
            threshold = threshold if trim else np.uint32(0)
            for q in range(width):
                delta = np.float32(as_float32(row[q]) - b[q])
                bits = np.float32(abs(delta)).view(np.uint32)
                kept = (bits > threshold) | ((bits == threshold) & (q < ties_end))
                delta = delta if kept else np.float32(delta * zero)  # ±0, as masking did
                delta = np.float32(delta * c)  # exact for c = 1
                # NaN goes into both sums (so it reaches the output, as in the torch kernels)
                positive[q] = np.float32(positive[q] + (zero if delta <= zero else delta))
                negative[q] = np.float32(negative[q] + (zero if delta >= zero else delta))
                up[q] = np.float32(up[q] + (c if delta > zero else zero))
                down[q] = np.float32(down[q] + (c if delta < zero else zero))
        for q in range(width):
            # all four loaded, then selected: a load from one row or the other vectorises only
            # with AVX-512's masked loads (on AVX2 it made TIES 3.6x slower)
            p, n, u, d = positive[q], negative[q], up[q], down[q]
            elected_up = not np.float32(p + n) < zero  # zero counts as +
            mixed = p if elected_up else n
            divisor = (u if elected_up else d) if normalize else one
            mixed = np.float32(mixed / (divisor if divisor != zero else one))  # exact for 1
            mixed = np.float32(mixed * lambda_)  # exact for λ = 1
            positive[q] = np.float32(b[q] + np.float32(mixed + zero))  # the result
        for q in range(width):  # a loop of its own: it vectorises only alone (measured 5x)
            store(block_out, q, positive[q])


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
        self._selection = Selection(check_cancel=self.check_cancel)
        self.chunk_elements = chunk_elements
        self.in_memory = 8 * chunk_elements  # every layer weight at the default chunk size
        self._rows = InputRows(plan, keep=True)  # reused from tensor to tensor

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        numel = math.prod(tensor.shape)
        # A tensor that fits is read once, for the selection and the combination alike.
        whole = self._inputs(tensor, 0, numel) if numel <= self.in_memory else None
        step = numel if whole is not None else self.chunk_elements

        def inputs(start: int, count: int, term: int | None = None) -> tuple[Array, Array]:
            """(base, terms) of those elements; with `term`, only that one of the terms."""
            if whole is None:
                return self._inputs(tensor, start, count, term)
            terms = whole[1] if term is None else whole[1][term : term + 1]
            return whole[0][start : start + count], terms[:, start : start + count]

        densities = self.settings.densities(tensor)
        trim = min(densities) < 1.0
        thresholds, cutoffs = self._trim_points(densities, numel, step, inputs)
        coefficients = np.array([t.coefficient for t in tensor.terms], np.float32)
        lambda_ = np.float32(self.settings.scale(tensor))
        # A tensor read whole is combined whole: a slice of its rows would not be contiguous,
        # and numba's code for such arrays does not vectorise (measured 3x slower).
        for start in range(0, numel, step):
            self.check_cancel()
            count = min(step, numel - start)
            base, terms = inputs(start, count)
            out = np.empty(count, np.uint16 if tensor.dtype == "BF16" else np.float32)
            parallel(
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
        self, densities: tuple[float, ...], numel: int, step: int,
        inputs: Callable[[int, int, int], tuple[Array, Array]],
    ) -> tuple[Array, Array]:  # fmt: skip
        """Per term, what `_select` finds (thresholds, tie cutoffs); for a term kept whole
        (density 1), threshold 0 with every tie kept. `inputs(start, count)` gives (base,
        terms) of those elements."""
        thresholds = np.zeros(len(densities), np.uint32)
        cutoffs = np.full(len(densities), numel, np.int64)
        for i, density in enumerate(densities):
            if density >= 1.0 or not numel:
                continue

            def delta_inputs(start: int, count: int, i: int = i) -> tuple[Array, Array]:
                base, terms = inputs(start, count, i)
                return terms[0], base

            k = self.settings.kept(numel, density)
            thresholds[i], cutoffs[i] = self._select(numel, k, step, delta_inputs)
        return thresholds, cutoffs

    def _select(self, numel: int, k: int, step: int, delta_inputs: DeltaInputs) -> tuple[int, int]:
        return self._selection.select(numel, k, step, delta_inputs)

    # -- reading --------------------------------------------------------------------------------
    def _inputs(
        self, tensor: TensorPlan, start: int, count: int, term: int | None = None
    ) -> tuple[Array, Array]:
        """The base's elements and every term's (or only the `term`-th), input_rows.py's
        kept buffer: overwritten by the next call."""
        terms = tensor.terms if term is None else tensor.terms[term : term + 1]
        sources = [self.settings.base, *(t.source for t in terms)]
        rows = self._rows.read(tensor, sources, start, count)
        return rows[0], rows[1:]
