"""ram and ramplus_tl in torch (Reinforced Agent Merging, arXiv 2601.13572, as mergekit 0.1.5's
`ram` and `ramplus_tl` compute them).

Per tensor, with δᵢ = Tᵢ − base for the N models: an entry of δᵢ takes part where
|δᵢ| > epsilon; c counts the models taking part at that entry. Where one model takes part
(c = 1) its δᵢ is added whole, where several do (c > 1) each adds δᵢ / c:
out = base + Σᵢ (δᵢ·[c = 1]·λᵢ + δᵢ·[c > 1] / c), over the δᵢ taking part.

ram: λᵢ = 1. ramplus_tl: λᵢ = 1 + r·clamp(ρᵢ, 0, α), ρᵢ = sᵢ / max(uᵢ, epsilon), sᵢ and uᵢ
the numbers of δᵢ's entries taking part where c > 1 and where c = 1, over the whole tensor.
The counts are integers, so a first pass a chunk at a time finds the same λᵢ as the whole
tensor; everything else is per entry, so a chunk's output equals the same entries of the whole
tensor's, in mergekit's operations and its type promotions (λ is float32: with bf16 inputs the
unique part, and so the result, is float32).
"""

from __future__ import annotations

import math

import torch

from engine.kernels.interpolation_torch import Read
from engine.kernels.torch_threads import using_threads
from engine.plan.model import TensorPlan

DEFAULT_EPSILON = 1e-5  # mergekit's: |δ| at or below it does not take part


class Ram:
    """One ram or ramplus_tl tensor: terms (model, 1)… then (base, 1); scalars epsilon, and
    r and alpha for ramplus_tl."""

    def __init__(self, read: Read, tensor: TensorPlan, *, chunk: int) -> None:
        self.read, self.tensor, self.step = read, tensor, chunk
        self.numel = math.prod(tensor.shape)
        self.sources = [term.source for term in tensor.terms]
        scalars = dict(tensor.scalars)
        self.epsilon = scalars.get("epsilon", DEFAULT_EPSILON)
        self.r, self.alpha = scalars.get("r"), scalars.get("alpha")
        self._lambdas: torch.Tensor | None = None
        self.threads = 0  # torch's (0: as set): each entry's arithmetic is its own

    def chunk(self, start: int, count: int) -> torch.Tensor:
        """Elements [start, start + count) of the output."""
        with using_threads(self.threads):
            base, deltas = self._deltas(start, count)
            if len(self.sources) == 1:  # no model besides the base
                return base
            if self.r is not None and self._lambdas is None:
                self._lambdas = self._tensor_lambdas()
            return merge(base, deltas, self.epsilon, self._lambdas)

    def _deltas(self, start: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        xs = [self.read(s, start, count) for s in self.sources]
        base = xs[-1]
        return base, torch.stack([x - base for x in xs[:-1]])

    def _tensor_lambdas(self) -> torch.Tensor:
        """λᵢ of ramplus_tl, from the counts over the whole tensor (one pass)."""
        assert self.r is not None and self.alpha is not None
        shared = unique = torch.zeros(len(self.sources) - 1, dtype=torch.int64)
        for start in range(0, self.numel, self.step):
            deltas = self._deltas(start, min(self.step, self.numel - start))[1]
            taking_part, counts = _taking_part(deltas, self.epsilon)
            shared = shared + (taking_part & (counts > 1)).sum(dim=1)
            unique = unique + (taking_part & (counts == 1)).sum(dim=1)
        rho = shared / unique.clamp(min=self.epsilon)
        return 1 + self.r * rho.clamp(min=0, max=self.alpha)


def _taking_part(deltas: torch.Tensor, epsilon: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per model and entry whether |δ| > epsilon; per entry how many models do."""
    taking_part = deltas.abs() > epsilon
    return taking_part, taking_part.sum(dim=0, keepdim=True)


def merge(
    base: torch.Tensor, deltas: torch.Tensor, epsilon: float, lambdas: torch.Tensor | None
) -> torch.Tensor:
    """base + Σᵢ over the models of their unique entries (× λᵢ) and shared ones ÷ c."""
    taking_part, counts = _taking_part(deltas, epsilon)
    kept = deltas * taking_part
    unique = kept * (counts == 1)
    if lambdas is not None:
        unique = unique * lambdas.unsqueeze(-1)
    shared = kept * (counts > 1) / counts.clamp(min=1)
    return base + (unique + shared).sum(dim=0)
