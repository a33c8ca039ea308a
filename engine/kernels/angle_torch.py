"""The arithmetic of nuslerp and model_stock in torch: per vector of a tensor (the whole
tensor, each row along the last dim, or each column along the first), coefficients from the
angles between the inputs' vectors, then an elementwise combination.

A vector that fits in a chunk is read once and measured with mergekit 0.1.5's own sequence of
float32 operations, so the bytes equal its output: the rows of a tensor a block at a time (a
row's norm and dot do not depend on the rows beside it), a whole tensor of up to a chunk in
one piece. A longer vector (the whole of a large tensor; the columns of a large one) is read
twice: first for its moments Σ xᵢ·xⱼ (float32 per chunk, float64 across chunks), then for the
output. mergekit reduces such a vector in one call, in an order set by its thread count, so its
cos θ and ours differ in the last bits and outputs by about an ulp.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

import torch

from engine.kernels.angle_rules import (
    COLINEAR,
    NORM_FLOOR,
    PRODUCT_FLOOR,
    SINGULAR,
    ModelStockTerms,
    NuslerpTerms,
    Pair,
    vectors_of,
)
from engine.kernels.interpolation_torch import Read
from engine.plan.model import ANGLE_OPS, TensorPlan

Tensors = Sequence[torch.Tensor]


class Nuslerp(NuslerpTerms):
    """angle_rules.NuslerpTerms, measured and combined in torch."""

    def angle_inputs(self, xs: Tensors) -> list[torch.Tensor]:
        return [xs[0] - xs[2], xs[1] - xs[2]] if self.with_base else [xs[0], xs[1]]

    def angle(self, vs: Tensors) -> torch.Tensor:
        """cos θ per vector (shape [..., 1]), exactly as mergekit's nuslerp finds it."""
        a, b = (v / torch.norm(v, dim=-1, keepdim=True).clamp(min=NORM_FLOOR) for v in vs)
        return torch.sum(a * b, dim=-1, keepdim=True).clamp(-1, 1)

    rounded_products = False  # its moments are exact (see AngleMerge._moments)

    def angle_from_moments(
        self, moments: dict[Pair, torch.Tensor], narrow: torch.dtype | None = None
    ) -> torch.Tensor:
        """cos θ from the moments, in float64 (rounded to a narrow dtype afterwards: mergekit
        normalises each entry in it before its dot, which moments cannot follow)."""
        norm_a = moments[0, 0].sqrt().clamp(min=NORM_FLOOR)
        norm_b = moments[1, 1].sqrt().clamp(min=NORM_FLOOR)
        return (moments[0, 1] / (norm_a * norm_b)).clamp(-1, 1).unsqueeze(-1)

    def coefficients(self, cos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        t = self.t
        colinear = (1 - cos.square()) <= COLINEAR
        # acos(0) on the colinear branch keeps the unused sin θ away from zero
        theta = torch.acos(torch.where(colinear, 0, cos))
        return colinear, torch.sin((1 - t) * theta), torch.sin(t * theta), torch.sin(theta)

    def output(
        self, coefficients: tuple[torch.Tensor, ...], xs: Tensors, vs: Tensors | None
    ) -> torch.Tensor:
        colinear, coef_a, coef_b, sin_theta = coefficients
        a, b = vs if vs is not None else self.angle_inputs(xs)
        t = self.t
        if bool(colinear.all()):
            out = (1 - t) * a + t * b
        else:
            out = (coef_a * a + coef_b * b) / sin_theta
            if bool(colinear.any()):
                out = torch.where(colinear, (1 - t) * a + t * b, out)
        return out + xs[2] if self.with_base else out


class ModelStock(ModelStockTerms):
    """angle_rules.ModelStockTerms, measured and combined in torch."""

    def angle_inputs(self, xs: Tensors) -> list[torch.Tensor]:
        return [x - xs[-1] for x in xs[:-1]]

    def angle(self, vs: Tensors) -> torch.Tensor:
        """The mean cos θ over pairs of task vectors (shape [..., 1]), as mergekit finds it."""
        cosines = []
        for i, a in enumerate(vs):
            for b in vs[i + 1 :]:
                product = torch.norm(a, dim=-1) * torch.norm(b, dim=-1)
                cosines.append(
                    ((a * b).sum(dim=-1) / product.clamp(min=PRODUCT_FLOOR)).clamp(-1, 1)
                )
        return torch.stack(cosines).mean(dim=0).unsqueeze(-1)

    rounded_products = True  # in a narrow dtype, Σ vᵢ·vⱼ (i ≠ j) of products rounded to it

    def angle_from_moments(
        self, moments: dict[Pair, torch.Tensor], narrow: torch.dtype | None = None
    ) -> torch.Tensor:
        """The mean cos θ from the moments: in float64, or in a narrow dtype with mergekit's
        steps in it (each norm, their product, the dot and the quotient rounded to it)."""
        cosines = []
        n = self.count
        for i in range(n):
            for j in range(i + 1, n):
                product = _to(moments[i, i].sqrt(), narrow) * _to(moments[j, j].sqrt(), narrow)
                dot = _to(moments[i, j], narrow)
                cosines.append((dot / product.clamp(min=PRODUCT_FLOOR)).clamp(-1, 1))
        return torch.stack(cosines).mean(dim=0).unsqueeze(-1)

    def coefficients(self, cos: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.count
        denominator = 1 + (n - 1) * cos
        singular = denominator.abs() < SINGULAR
        safe = torch.where(singular, torch.ones_like(denominator), denominator)
        t = torch.where(singular, torch.zeros_like(cos), (n * cos) / safe)
        return t, 1 - t

    def output(
        self, coefficients: tuple[torch.Tensor, ...], xs: Tensors, vs: Tensors | None
    ) -> torch.Tensor:
        t, rest = coefficients
        total = xs[0] + xs[1]
        for x in xs[2:-1]:
            total.add_(x)
        # mergekit sums from 0 (Python's sum): the same bits as adding 0 last, which only
        # turns an all −0.0 sum into +0.0
        average = total.add_(0.0).div_(self.count)
        return average.mul_(t).add_(xs[-1] * rest)


# What a method does per vector: `sources`, the inputs it reads in order; `angle_inputs`, the
# vectors whose angles count (the inputs, or their differences from the base) along the last
# dim; `angle`, their cos θ measured whole as mergekit does; `angle_from_moments`, the same
# from Σ vᵢ·vⱼ (`pairs`) for a vector read in pieces; `coefficients` from cos θ; `output`.
Rule = Nuslerp | ModelStock
RULES: dict[str, type[Rule]] = {
    "nuslerp": Nuslerp, "nuslerp_rows": Nuslerp, "nuslerp_columns": Nuslerp,
    "model_stock": ModelStock, "model_stock_rows": ModelStock,
}  # fmt: skip
assert set(RULES) == ANGLE_OPS


class AngleMerge:
    """One planned tensor's output, chunk by chunk in order, each in the arithmetic dtype.

    `chunk`: the most elements of one input read at once to measure a vector (larger vectors
    are measured by moments); `block`: elements per output chunk (the arithmetic's
    temporaries stay in the CPU's cache, as in torch_kernels.py)."""

    def __init__(self, read: Read, tensor: TensorPlan, *, chunk: int, block: int) -> None:
        self.read = read
        self.rule: Rule = RULES[tensor.op](tensor)
        self.shape = tensor.shape
        self.vectors = vectors_of(tensor.op, tensor.shape)
        self.chunk, self.block = chunk, block
        self.narrow: torch.dtype | None = None  # the inputs' bf16 or fp16, when they are

    def chunks(self) -> Iterator[torch.Tensor]:
        v = self.vectors
        numel = v.rows * v.length
        if numel == 0:
            return iter(())
        if v.columns:
            return self._whole() if numel <= self.chunk else self._columns()
        return self._rows() if v.length <= self.chunk else self._long_rows()

    def _inputs(self, start: int, count: int) -> list[torch.Tensor]:
        return [self.read(source, start, count) for source in self.rule.sources]

    def _measured(self, xs: Tensors) -> torch.Tensor:
        """The output of vectors read whole (along the last dim of xs), bit for bit mergekit's."""
        rule = self.rule
        vs = rule.angle_inputs(xs)
        return rule.output(rule.coefficients(rule.angle(vs)), xs, vs)

    def _rows(self) -> Iterator[torch.Tensor]:
        """Whole rows, a block of them at a time, each block read once."""
        v = self.vectors
        per_block = max(1, self.block // v.length)
        for first in range(0, v.rows, per_block):
            rows = min(per_block, v.rows - first)
            xs = self._inputs(first * v.length, rows * v.length)
            yield self._measured([x.view(rows, v.length) for x in xs]).view(-1)

    def _whole(self) -> Iterator[torch.Tensor]:
        """A tensor of at most a chunk whose vectors are its columns: read once, transposed as
        mergekit does, so that each column is reduced in the same order."""
        xs = [x.view(self.shape).transpose(0, -1) for x in self._inputs(0, math.prod(self.shape))]
        yield self._measured(xs).transpose(0, -1).reshape(-1)

    def _long_rows(self) -> Iterator[torch.Tensor]:
        """Rows longer than a chunk (a whole large tensor): moments, then the output."""
        length = self.vectors.length
        for row in range(self.vectors.rows):
            begin, end = row * length, (row + 1) * length
            moments = self._moments(range(begin, end, self.chunk), end, _as_is, dim=-1)
            yield from self._outputs(moments, begin, end, _as_is)

    def _columns(self) -> Iterator[torch.Tensor]:
        """Columns of a tensor larger than a chunk: their moments over blocks of whole rows,
        then the output."""
        v = self.vectors
        numel = v.rows * v.length
        read_step = max(1, self.chunk // v.length) * v.length

        def as_rows(x: torch.Tensor) -> torch.Tensor:
            return x.view(-1, v.length)

        moments = self._moments(range(0, numel, read_step), numel, as_rows, dim=0)
        step = max(1, self.block // v.length) * v.length
        yield from self._outputs(moments, 0, numel, as_rows, step)

    def _moments(
        self, starts: range, end: int, shaped: Callable[[torch.Tensor], torch.Tensor], *, dim: int
    ) -> dict[Pair, torch.Tensor]:
        """Σ vᵢ·vⱼ along `dim` for the rule's pairs, per chunk in float32, summed in float64. In
        mergekit's narrow arithmetic (bf16, fp16: `self.narrow` is set) the products of its
        rounded entries are exact, or rounded to it where the rule's are (model_stock's dots),
        and summed in float64."""
        total: dict[Pair, torch.Tensor] = {}
        for start in starts:
            xs = [shaped(x) for x in self._inputs(start, min(starts.step, end - start))]
            vs = self.rule.angle_inputs(xs)
            for i, j in self.rule.pairs:
                a, b = vs[i], vs[j]
                if a.dtype in (torch.bfloat16, torch.float16):
                    self.narrow = a.dtype
                    rounded = i != j and self.rule.rounded_products
                    product = (a * b).double() if rounded else a.double() * b.double()
                else:
                    product = a * b
                part = product.sum(dim=dim).double()
                total[i, j] = total[i, j] + part if (i, j) in total else part
        return total

    def _outputs(
        self,
        moments: dict[Pair, torch.Tensor],
        begin: int,
        end: int,
        shaped: Callable[[torch.Tensor], torch.Tensor],
        step: int | None = None,
    ) -> Iterator[torch.Tensor]:
        cos = self.rule.angle_from_moments(moments, self.narrow)  # [vectors, 1]
        if self.vectors.columns:
            cos = cos.view(1, -1)  # one per column of the blocks of rows read below
        coefficients: tuple[torch.Tensor, ...] = ()
        step = step or self.block
        for start in range(begin, end, step):
            xs = [shaped(x) for x in self._inputs(start, min(step, end - start))]
            if not coefficients:  # in the inputs' arithmetic dtype, as mergekit's
                coefficients = self.rule.coefficients(cos.to(xs[0].dtype))
            yield self.rule.output(coefficients, xs, None).reshape(-1)


def _as_is(x: torch.Tensor) -> torch.Tensor:
    return x


def _to(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return x if dtype is None else x.to(dtype)
