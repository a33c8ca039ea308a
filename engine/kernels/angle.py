"""nuslerp and model_stock on the CPU: angle_torch.py's arithmetic, the elementwise work and the
long vectors' moments compiled with numba, each a single pass over the raw input bytes.

angle_torch.py computes in torch: a dozen whole-chunk operations per chunk, each a pass over memory,
bf16 widened and float32 narrowed by passes of their own, and a large tensor (one angle per
tensor, the methods' default) read twice. Here:

- **moments** of a vector longer than a chunk: Σ vᵢ·vⱼ for the rule's pairs, each product
  exact in float64, in pieces of 64K elements summed in order (so the same whatever the
  threads; inside a piece in whichever order vectorises, which moves a float64 sum's last bits,
  far below the float32 cos θ made from it). A tensor whose inputs fit in `in_memory` bytes is
  read once for its moments and its output, a larger one twice.
- **output**: angle_torch.py's elementwise arithmetic, float32 steps in the same order (the same
  bits for the same coefficients), rounded once to the output dtype.

What mergekit's bytes depend on stays in torch: the norms and dots of vectors read whole (every
row; a whole tensor of up to a chunk), by angle_torch.py's own operations on the widened rows, and
nuslerp's coefficients (sines) from cos θ. model_stock's coefficients of a vector measured by its
moments are IEEE steps alone, taken without torch (angle_rules.py), so such tensors are merged
while torch loads on a thread of its own. Compiled code is cached on disk (numba's `cache=True`).
"""

from __future__ import annotations

import functools
import importlib
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import numba
import numpy as np

from engine.io.memory import keep_freed_memory
from engine.kernels.angle_rules import TERMS, ModelStockTerms, NuslerpTerms, Terms, vectors_of
from engine.kernels.float_bits import as_float32, store
from engine.kernels.input_rows import Array, InputRows, readable
from engine.kernels.parallel import THREADS, over
from engine.plan.model import Plan, TensorPlan

if TYPE_CHECKING:
    import torch

    from engine.kernels.torch_kernels import Kernels

_PIECE = 1 << 16  # elements per partial moment sum: a fixed split, whatever the threads
_BLOCK = 512  # elements per inner loop: the float32 rows stay in the L1 cache

_jit = numba.njit(nogil=True, cache=True)


def handles(plan: Plan, device: str) -> bool:
    """Whether every tensor the plan does not copy is a nuslerp or model_stock of one dtype."""
    if device != "cpu" or sys.byteorder != "little":
        return False
    for tensor in plan.tensors:
        if tensor.op == "copy":
            continue
        if tensor.op not in TERMS or not readable(plan, tensor, (t.source for t in tensor.terms)):
            return False
    return True


# -- compiled kernels ---------------------------------------------------------------------------
@numba.njit(nogil=True, cache=True, fastmath={"reassoc"})
def _dot(a: Array, b: Array) -> float:
    """Σ a·b of float32 rows, each product exact in float64, summed in whatever order
    vectorises: a float64 sum's last bits, far below the float32 cos θ it makes."""
    total = 0.0
    for q in range(a.shape[0]):
        total += np.float64(a[q]) * np.float64(b[q])
    return total


@_jit
def _moments(
    inputs: Array, vectors: int, from_base: bool, pairs: Array, out: Array, lo: int, hi: int
) -> None:
    """out[p, k] = Σ vᵢ·vⱼ over piece p (for p in [lo, hi)) for pair k = (i, j), where v is
    inputs[i], or inputs[i] − inputs[-1] when `from_base` (float32, as torch subtracts)."""
    count = inputs.shape[1]
    deltas = np.empty((vectors, _BLOCK), np.float32)
    for piece in range(lo, hi):
        out[piece, :] = 0.0
        end = min(count, (piece + 1) * _PIECE)
        for start in range(piece * _PIECE, end, _BLOCK):
            width = min(_BLOCK, end - start)
            base = inputs[-1, start : start + width]
            for i in range(vectors):
                row, delta = inputs[i, start : start + width], deltas[i]
                if from_base:
                    for q in range(width):
                        delta[q] = np.float32(as_float32(row[q]) - as_float32(base[q]))
                else:
                    for q in range(width):
                        delta[q] = as_float32(row[q])
            for k in range(pairs.shape[0]):
                out[piece, k] += _dot(deltas[pairs[k, 0], :width], deltas[pairs[k, 1], :width])


@_jit
def _widen(inputs: Array, from_base: bool, out: Array, lo: int, hi: int) -> None:
    """out[i] = inputs[i] as float32, or inputs[i] − inputs[-1] when `from_base` (float32,
    as torch subtracts): the vectors whose angles angle_torch.py measures."""
    for i in range(out.shape[0]):
        row, base, widened = inputs[i, lo:hi], inputs[-1, lo:hi], out[i, lo:hi]
        if from_base:
            for q in range(hi - lo):
                widened[q] = np.float32(as_float32(row[q]) - as_float32(base[q]))
        else:
            for q in range(hi - lo):
                widened[q] = as_float32(row[q])


@_jit
def _nuslerp(
    inputs: Array, from_base: bool, colinear: Array, coefficients: Array, length: int,
    out: Array, first: int, lo: int, hi: int,
) -> None:  # fmt: skip
    """angles.Nuslerp.output of elements [lo, hi) of rows of `length` into out[lo - first:];
    per row: whether colinear, and
    coefficients sin((1−t)θ), sin(tθ), sin θ, 1 − t, t. A colinear row's (1 − t)·a + t·b is
    computed as ((1 − t)·a + t·b) / 1, the same bits, so that one loop does both."""
    result = np.empty(_BLOCK, np.float32)
    one = np.float32(1.0)
    for row in range(lo // length, (hi - 1) // length + 1):
        if colinear[row]:
            coef_a, coef_b, divisor = coefficients[3, row], coefficients[4, row], one
        else:
            coef_a, coef_b = coefficients[0, row], coefficients[1, row]
            divisor = coefficients[2, row]
        end = min(hi, (row + 1) * length)
        for start in range(max(lo, row * length), end, _BLOCK):
            width = min(_BLOCK, end - start)
            x, y = inputs[0, start : start + width], inputs[1, start : start + width]
            base = inputs[-1, start : start + width]
            block_out = out[start - first : start - first + width]
            if from_base:
                for q in range(width):
                    b = as_float32(base[q])
                    delta_a = np.float32(as_float32(x[q]) - b)
                    delta_b = np.float32(as_float32(y[q]) - b)
                    r = np.float32(np.float32(coef_a * delta_a) + np.float32(coef_b * delta_b))
                    result[q] = np.float32(np.float32(r / divisor) + b)
            else:
                for q in range(width):
                    a, b = as_float32(x[q]), as_float32(y[q])
                    r = np.float32(np.float32(coef_a * a) + np.float32(coef_b * b))
                    result[q] = np.float32(r / divisor)
            for q in range(width):  # a loop of its own: it vectorises only alone
                store(block_out, q, result[q])


@_jit
def _model_stock(
    inputs: Array, coefficients: Array, length: int, out: Array, first: int, lo: int, hi: int
) -> None:
    """angles.ModelStock.output of elements [lo, hi) of rows of `length` into out[lo - first:],
    coefficients t and 1 − t per row: (Σ models + 0) / N · t + base · (1 − t)."""
    models = inputs.shape[0] - 1
    n, zero = np.float32(models), np.float32(0.0)
    total = np.empty(_BLOCK, np.float32)
    for row in range(lo // length, (hi - 1) // length + 1):
        t, rest = coefficients[0, row], coefficients[1, row]
        end = min(hi, (row + 1) * length)
        for start in range(max(lo, row * length), end, _BLOCK):
            width = min(_BLOCK, end - start)
            block_out = out[start - first : start - first + width]
            model = inputs[0, start : start + width]
            for q in range(width):
                total[q] = as_float32(model[q])
            for i in range(1, models):
                other = inputs[i, start : start + width]
                for q in range(width):
                    total[q] = np.float32(total[q] + as_float32(other[q]))
            base = inputs[-1, start : start + width]
            for q in range(width):
                average = np.float32(np.float32(total[q] + zero) / n)
                total[q] = np.float32(
                    np.float32(average * t) + np.float32(as_float32(base[q]) * rest)
                )
            for q in range(width):
                store(block_out, q, total[q])


# -- the driver ---------------------------------------------------------------------------------
class AngleKernels:
    def __init__(
        self,
        plan: Plan,
        *,
        chunk_elements: int,
        check_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        self._rows = InputRows(plan)
        keep_freed_memory()  # chunk buffers are reused, not page-faulted in again
        self.check_cancel = check_cancel or (lambda: None)
        self.chunk_elements = chunk_elements
        # A long vector whose inputs take up to this many bytes is read once, not twice: 96 MB
        # at the default chunk, a 1.8B model's MLP weights of three bf16 inputs (69 MB, read
        # twice: 6.6 GB more to read, 0.5 s of a 6 s model_stock) but not its embeddings.
        self.in_memory = 48 * chunk_elements
        # torch loads on a thread of its own while the tensors that need none are merged
        # (a model_stock's embeddings and head, measured by moments, come first).
        if any(self._needs_torch(t) for t in plan.tensors if t.op in TERMS):
            threading.Thread(
                target=importlib.import_module, args=("engine.kernels.angle_torch",), daemon=True
            ).start()

    def _needs_torch(self, tensor: TensorPlan) -> bool:
        """Whether mergekit's torch operations measure the tensor's vectors (read whole), or
        torch finds its coefficients (nuslerp's sines)."""
        vectors = vectors_of(tensor.op, tensor.shape)
        measured_whole = vectors.columns or vectors.length <= self.chunk_elements
        return measured_whole or TERMS[tensor.op] is NuslerpTerms

    @functools.cached_property
    def columns(self) -> Kernels:
        """Columns are measured in torch (torch_kernels.py): nuslerp_row_wise, the rare choice."""
        # torch (torch_kernels.py): seconds to import; only column-wise angles need it
        from engine.kernels.torch_kernels import Kernels

        return Kernels(
            self.plan, device="cpu", chunk_elements=self.chunk_elements,
            check_cancel=self.check_cancel,
        )  # fmt: skip

    def output_bytes(self, tensor: TensorPlan) -> Iterator[memoryview]:
        """The tensor's output bytes, a chunk at a time, in order."""
        vectors = vectors_of(tensor.op, tensor.shape)
        if vectors.rows * vectors.length == 0:
            return iter(())
        if vectors.columns:
            return self.columns.output_bytes(tensor)
        if vectors.length <= self.chunk_elements:
            return self._measured_rows(tensor, vectors.rows, vectors.length)
        return self._long_rows(tensor, vectors.rows, vectors.length)

    def _measured_rows(self, tensor: TensorPlan, rows: int, length: int) -> Iterator[memoryview]:
        """Rows of up to a chunk, a chunk of whole rows at a time, each read once: their angles
        by angle_torch.py's torch operations on the rows (mergekit's reductions), the rest here."""
        # torch (and angle_torch.py, built on it): seconds to import; only nuslerp's sines need it
        import torch

        from engine.kernels.angle_torch import RULES

        rule = RULES[tensor.op](tensor)
        per_chunk = max(1, self.chunk_elements // length)
        for first in range(0, rows, per_chunk):
            self.check_cancel()
            count = min(per_chunk, rows - first) * length
            inputs = self._inputs(tensor, rule, first * length, count)
            vectors = np.empty((rule.vectors, count), np.float32)
            over(_widen, 0, count, inputs, rule.from_base, vectors, slices=_slices(count))
            as_rows = [torch.from_numpy(v).view(-1, length) for v in vectors]
            table = _table(rule, rule.coefficients(rule.angle(as_rows)))
            yield self._output(tensor, rule, inputs, table, length, 0, count)

    def _long_rows(self, tensor: TensorPlan, rows: int, length: int) -> Iterator[memoryview]:
        """Rows longer than a chunk (a whole large tensor): moments, then the output. A row
        whose inputs fit in `in_memory` bytes is read once for both, a longer one twice, a
        chunk at a time."""
        terms = TERMS[tensor.op](tensor)
        whole = len(terms.sources) * length * _loaded_itemsize(self.plan, tensor) <= self.in_memory
        step = self.chunk_elements
        for row in range(rows):
            begin, end = row * length, (row + 1) * length
            if whole:
                self.check_cancel()
                inputs = self._inputs(tensor, terms, begin, length)
                table = _table_from_moments(tensor, terms, self._moments(inputs, terms))
                for start in range(0, length, step):
                    self.check_cancel()
                    stop = min(length, start + step)
                    yield self._output(tensor, terms, inputs, table, length, start, stop)
                continue
            moments = np.zeros(len(terms.pairs), np.float64)
            for start in range(begin, end, step):
                self.check_cancel()
                moments += self._moments(
                    self._inputs(tensor, terms, start, min(step, end - start)), terms
                )
            table = _table_from_moments(tensor, terms, moments)
            for start in range(begin, end, step):
                self.check_cancel()
                count = min(step, end - start)
                inputs = self._inputs(tensor, terms, start, count)
                yield self._output(tensor, terms, inputs, table, count, 0, count)

    def _output(
        self, tensor: TensorPlan, terms: Terms, inputs: Array, table: Table, length: int,
        lo: int, hi: int,
    ) -> memoryview:  # fmt: skip
        """The output bytes of elements [lo, hi) of `inputs`, rows of `length` elements with
        their coefficients (`table`, a column per row)."""
        count = hi - lo
        out = np.empty(count, np.uint16 if tensor.dtype == "BF16" else np.float32)
        if isinstance(terms, NuslerpTerms):
            colinear, values = table
            over(_nuslerp, lo, hi, inputs, terms.with_base, colinear, values, length, out, lo,
                 slices=_slices(count))  # fmt: skip
        else:
            over(_model_stock, lo, hi, inputs, table[1], length, out, lo, slices=_slices(count))
        if tensor.dtype == "F16":
            out = out.astype(np.float16)  # round to nearest-even, as torch does
        return out.view(np.uint8).data

    def _moments(self, inputs: Array, terms: Terms) -> Array:
        """Σ vᵢ·vⱼ over `inputs` for the pairs, in float64: over pieces of a fixed size,
        summed in order, so the same on any number of threads."""
        pieces = np.empty((-(-inputs.shape[1] // _PIECE), len(terms.pairs)), np.float64)
        pairs = np.array(terms.pairs, np.int64)
        over(_moments, 0, len(pieces), inputs, terms.vectors, terms.from_base, pairs,
             pieces, slices=min(THREADS, len(pieces)))  # fmt: skip
        totals = np.zeros(len(terms.pairs), np.float64)
        for piece in pieces:
            totals += piece
        return totals

    def _inputs(self, tensor: TensorPlan, terms: Terms, start: int, count: int) -> Array:
        """The inputs' elements (input_rows.py)."""
        return self._rows.read(tensor, terms.sources, start, count)


# Per row: (colinear, [sin((1−t)θ), sin(tθ), sin θ, 1 − t, t]) for nuslerp, (None, [t, 1 − t])
# for model_stock, float32 as the kernels read them.
Table = tuple[Array | None, Array]


def _table(terms: Terms, coefficients: tuple[torch.Tensor, ...]) -> Table:
    """The kernels' table from angle_torch.py's coefficients (torch tensors, one per row)."""
    per_row = [c.reshape(-1).numpy() for c in coefficients]
    if isinstance(terms, NuslerpTerms):
        colinear, *values = per_row
        # torch multiplies by 1 − t and t as float32 scalars: so does _nuslerp
        lerp = [np.full_like(values[0], 1 - terms.t), np.full_like(values[0], terms.t)]
        return colinear, np.stack([*values, *lerp]).astype(np.float32)
    return None, np.stack(per_row).astype(np.float32)


def _table_from_moments(tensor: TensorPlan, terms: Terms, moments: Array) -> Table:
    """The table of one vector measured by its moments: model_stock's without torch,
    nuslerp's sines by angle_torch.py's torch operations."""
    if isinstance(terms, ModelStockTerms):
        return None, terms.table_from_moments(moments)
    # torch (and angle_torch.py, built on it): seconds to import; only nuslerp's sines need it
    import torch

    from engine.kernels.angle_torch import RULES

    rule = RULES[tensor.op](tensor)
    by_pair = {pair: torch.tensor(moments[k]) for k, pair in enumerate(terms.pairs)}
    return _table(terms, rule.coefficients(rule.angle_from_moments(by_pair).to(torch.float32)))


def _slices(elements: int) -> int:
    return THREADS if elements >= _PIECE else 1


def _loaded_itemsize(plan: Plan, tensor: TensorPlan) -> int:
    """Bytes per element of an input as _inputs holds it (BF16 as is, F16 widened)."""
    return (
        2
        if plan.checkpoints[tensor.terms[0].source].tensors[tensor.read_name].dtype == "BF16"
        else 4
    )
