"""The arithmetic of mergekit-compatible methods (linear, slerp), in torch, per chunk.

Their bytes equal mergekit 0.1.5's only when every step is the same float32 (float64 for F64
inputs) operation in the same order and shape, so this follows its kernels step by step: the
weighted sum is fused multiply-adds (addcmul) from zero; slerp's norms are norms of per-chunk
norms and its dot a sum of per-chunk dots over vectors divided by their norms. Statistics are
kept per chunk (a few scalars), so memory stays one chunk per input whatever the tensor size.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from engine.plan import TensorPlan

# (source, start, count) -> that input's elements, widened to the arithmetic dtype
Read = Callable[[int, int, int], torch.Tensor]
DOT_THRESHOLD = 0.9995  # above it (nearly collinear) slerp interpolates linearly, as mergekit
NORM_EPS = 1e-8  # a smaller norm counts as 1: a zero tensor is not divided by zero


def weighted(read: Read, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
    """Σ c_i·x_i by fused multiply-adds in term order; ÷ Σ c_i for a weighted_mean."""
    total: torch.Tensor | None = None
    coefficients: torch.Tensor | None = None
    for i, term in enumerate(tensor.terms):
        x = read(term.source, start, count).view(1, -1)
        if total is None:
            coefficients = torch.tensor([[t.coefficient for t in tensor.terms]], dtype=x.dtype)
            total = torch.zeros_like(x)
        assert coefficients is not None
        total.addcmul_(x, coefficients[:, i : i + 1])
    assert total is not None and coefficients is not None
    if tensor.op == "weighted_mean":
        total.div_(coefficients.sum(dim=1).reshape(1, 1))
    return total.view(-1)


class Slerp:
    """One tensor's slerp: the coefficients from its norms and dot, then output chunks."""

    def __init__(self, read: Read, tensor: TensorPlan, step: int) -> None:
        self.read, self.step = read, step
        self.first, self.second = tensor.terms[0].source, tensor.terms[1].source
        self.numel = math.prod(tensor.shape)
        self.t = tensor.terms[1].coefficient
        self.coefficients: tuple[torch.Tensor, torch.Tensor] | None = None

    def chunk(self, start: int, count: int) -> torch.Tensor:
        if self.coefficients is None:
            self.coefficients = self._coefficients()
        coef_a, coef_b = self.coefficients
        a, b = self._pair(start, count)  # fresh buffers: computed in place (same values)
        return a.mul_(coef_a).add_(b.mul_(coef_b)).view(-1)

    def _pair(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        a = self.read(self.first, start, count).view(1, -1)
        return a, self.read(self.second, start, count).view(1, -1)

    def _spans(self) -> list[tuple[int, int]]:
        return [(s, min(self.step, self.numel - s)) for s in range(0, self.numel, self.step)]

    def _coefficients(self) -> tuple[torch.Tensor, torch.Tensor]:
        norms_a, norms_b = [], []
        for start, count in self._spans():
            a, b = self._pair(start, count)
            norms_a.append(torch.linalg.vector_norm(a, dim=1, keepdim=True))
            norms_b.append(torch.linalg.vector_norm(b, dim=1, keepdim=True))
        norm_a, norm_b = _norm_of(norms_a), _norm_of(norms_b)
        dots = []
        for start, count in self._spans():
            a, b = self._pair(start, count)
            dots.append(a.div_(norm_a).mul_(b.div_(norm_b)).sum(dim=1, keepdim=True))
        dot = torch.stack(dots).sum(dim=0).clamp(-1, 1)
        t = torch.tensor([[self.t]], dtype=dot.dtype)
        collinear = dot.abs() > DOT_THRESHOLD
        # acos(0) on the collinear branch keeps the unused sin θ away from zero
        theta = torch.acos(torch.where(collinear, 0, dot))
        sin_theta = torch.sin(theta)
        coef_a = torch.where(collinear, 1 - t, torch.sin((1 - t) * theta) / sin_theta)
        coef_b = torch.where(collinear, t, torch.sin(t * theta) / sin_theta)
        return coef_a, coef_b


def _norm_of(parts: list[torch.Tensor]) -> torch.Tensor:
    norm = torch.linalg.vector_norm(torch.stack(parts), dim=0)
    return torch.where(norm > NORM_EPS, norm, 1)
