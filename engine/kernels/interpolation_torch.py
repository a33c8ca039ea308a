"""The arithmetic of mergekit-compatible methods (linear, slerp), in torch, per chunk.

Their bytes equal mergekit 0.1.5's only when every step is the same float32 (float64 for F64
inputs) operation in the same order and shape, so this follows its kernels step by step: the
weighted sum is fused multiply-adds (addcmul) from zero; slerp's norms are norms of per-chunk
norms and its dot a sum of per-chunk dots over vectors divided by their norms. Statistics are
kept per chunk (a few scalars) and inputs at most up to a bound (Slerp), so memory does not
grow with a tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.kernels.workspace import Workspace
from engine.plan.model import TensorPlan

# (source, start, count) -> that input's elements, widened to the arithmetic dtype
Read = Callable[[int, int, int], torch.Tensor]
# (source, start, out) -> that input's elements from `start` widened into `out` (1-D)
ReadInto = Callable[[int, int, torch.Tensor], None]
DOT_THRESHOLD = 0.9995  # above it (nearly collinear) slerp interpolates linearly, as mergekit
NORM_EPS = 1e-8  # a smaller norm counts as 1: a zero tensor is not divided by zero


def weighted(read: Read, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
    """Σ c_i·x_i by fused multiply-adds in term order; ÷ Σ c_i for a weighted_mean."""
    total: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    for i, term in enumerate(tensor.terms):
        x = read(term.source, start, count).view(1, -1)
        if total is None:
            coefficients = torch.tensor(
                [[t.coefficient for t in tensor.terms]], dtype=x.dtype, device=x.device
            )
            total = torch.zeros_like(x)
        assert coefficients is not None
        total.addcmul_(x, coefficients[:, i : i + 1])
    assert total is not None and coefficients is not None
    if tensor.op == "weighted_mean":
        total.div_(coefficients.sum(dim=1).reshape(1, 1))
    return total.view(-1)


class Slerp:
    """One tensor's slerp: the coefficients from its norms and dot, then output chunks.

    Each input is read into buffers of the workspace, never into fresh ones (workspace.py). A
    tensor of up to `cache_elements` is read once and kept widened for all three passes (every
    layer weight of a 1.8B model: a third of the reads and widenings); a larger one (an
    embedding) is read again for each pass, a span at a time.
    """

    def __init__(
        self, read_into: ReadInto, tensor: TensorPlan, *, step: int, cache_elements: int,
        workspace: Workspace, dtype: torch.dtype, output: torch.dtype,
    ) -> None:  # fmt: skip
        self.read_into, self.step, self.workspace = read_into, step, workspace
        self.dtype, self.output = dtype, output
        self.first, self.second = tensor.terms[0].source, tensor.terms[1].source
        self.numel = math.prod(tensor.shape)
        self.t = tensor.terms[1].coefficient
        self.cached = self.numel <= cache_elements
        self.coefficients: tuple[torch.Tensor, torch.Tensor] | None = None

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output, in a new tensor of its dtype."""
        if self.coefficients is None:
            self.coefficients = self._coefficients()
        coef_a, coef_b = self.coefficients
        a, b, into_a, into_b = self._pair(start, count)
        mixed = torch.mul(a, coef_a, out=into_a).add_(torch.mul(b, coef_b, out=into_b))
        out = torch.empty(count, dtype=self.output, device=mixed.device)
        return out.copy_(mixed.view(-1))

    def _pair(
        self, start: int, count: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both inputs' elements [start, start + count) as (1, count) tensors, and where to
        put what is computed from them: the same buffers when they were read for this call,
        scratch buffers when they are the tensor's cached inputs (read by the first pass)."""
        if self.cached:
            a = self.workspace.take("slerp.a", self.dtype, self.numel)[start : start + count]
            b = self.workspace.take("slerp.b", self.dtype, self.numel)[start : start + count]
            into_a = self.workspace.take("slerp.scratch_a", self.dtype, count)
            into_b = self.workspace.take("slerp.scratch_b", self.dtype, count)
            return a.view(1, -1), b.view(1, -1), into_a.view(1, -1), into_b.view(1, -1)
        a = self.workspace.take("slerp.a", self.dtype, count)
        b = self.workspace.take("slerp.b", self.dtype, count)
        self.read_into(self.first, start, a)
        self.read_into(self.second, start, b)
        return a.view(1, -1), b.view(1, -1), a.view(1, -1), b.view(1, -1)

    def _spans(self) -> list[tuple[int, int]]:
        return [(s, min(self.step, self.numel - s)) for s in range(0, self.numel, self.step)]

    def _read_cache(self) -> None:
        a = self.workspace.take("slerp.a", self.dtype, self.numel)
        b = self.workspace.take("slerp.b", self.dtype, self.numel)
        for start, count in self._spans():  # span by span: a cancel is noticed as often
            self.read_into(self.first, start, a[start : start + count])
            self.read_into(self.second, start, b[start : start + count])

    def _coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        # One tensor per statistic, made before the passes: a small tensor per span, kept to
        # the end of a pass, split the chunk buffers freed around it (workspace.py).
        spans = self._spans()
        device = self.workspace.device
        norms_a, norms_b, dots = (
            torch.empty((len(spans), 1, 1), dtype=self.dtype, device=device) for _ in range(3)
        )
        if self.cached:
            self._read_cache()
        for i, (start, count) in enumerate(spans):
            a, b, _, _ = self._pair(start, count)
            torch.linalg.vector_norm(a, dim=1, keepdim=True, out=norms_a[i])
            torch.linalg.vector_norm(b, dim=1, keepdim=True, out=norms_b[i])
        norm_a, norm_b = _norm_of(norms_a), _norm_of(norms_b)
        for i, (start, count) in enumerate(spans):
            a, b, into_a, into_b = self._pair(start, count)
            product = torch.div(a, norm_a, out=into_a).mul_(torch.div(b, norm_b, out=into_b))
            torch.sum(product, dim=1, keepdim=True, out=dots[i])
        dot = dots.sum(dim=0).clamp(-1, 1)
        t = torch.tensor([[self.t]], dtype=dot.dtype, device=dot.device)
        collinear = dot.abs() > DOT_THRESHOLD
        # acos(0) on the collinear branch keeps the unused sin θ away from zero
        theta = torch.acos(torch.where(collinear, 0, dot))
        sin_theta = torch.sin(theta)
        coef_a = torch.where(collinear, 1 - t, torch.sin((1 - t) * theta) / sin_theta)
        coef_b = torch.where(collinear, t, torch.sin(t * theta) / sin_theta)
        return coef_a, coef_b


def _norm_of(parts: torch.Tensor) -> torch.Tensor:
    """The norm of the per-span norms (shape (spans, 1, 1)); a tiny one counts as 1."""
    norm = torch.linalg.vector_norm(parts, dim=0)
    return torch.where(norm > NORM_EPS, norm, 1)
