"""Plain-torch references for the sparsifying methods (docs/concepts/methods.md), written from
mergekit 0.1.5's formulas on whole tensors in memory, float32.

The engine is used for one thing only: the random bits of DARE's and DELLA's drops
(engine.kernels.random_bits.random_bits), so that a reference can be given the engine's masks;
the rule that turns bits into a mask (bits < p·2³²) and everything else is computed here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine.kernels.random_bits import random_bits
from tests.reference import layer_of

SCALE = 2.0**32


def stable_ranks(magnitude: torch.Tensor) -> torch.Tensor:
    """Rank from 0 of each entry along the last dim, smallest first, equal ones in flat order."""
    order = torch.sort(magnitude, dim=-1, stable=True).indices
    ranks = torch.empty_like(order)
    ranks.scatter_(-1, order, torch.arange(magnitude.shape[-1]).expand_as(order).contiguous())
    return ranks


def breadcrumbs_mask(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Ranks [bottom, bottom + target) of |δ| from the smallest: target = ⌊density·n⌋ below the
    ⌊gamma·n⌋ largest."""
    n = delta.numel()
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    ranks = stable_ranks(delta.abs().reshape(-1)).view(delta.shape)
    return (ranks >= bottom) & (ranks < bottom + target)


def bits_of(seed: int, name: str, term: int, n: int) -> torch.Tensor:
    return torch.from_numpy(random_bits(seed, name, term, 0, n).astype("int64"))


def dare_mask(delta: torch.Tensor, density: float, seed: int, name: str, term: int) -> torch.Tensor:
    bits = bits_of(seed, name, term, delta.numel()).double()
    return (bits < density * SCALE).view(delta.shape)


def della_mask(
    delta: torch.Tensor, density: float, epsilon: float, seed: int, name: str, term: int
) -> torch.Tensor:
    """Keep probability (density − ε) + 2ε·r/(m − 1) by rank r of |δ| in its row of m, in
    float32 as mergekit computes it; kept where the bits are below it."""
    rows = delta.reshape(1, -1) if delta.dim() == 1 else delta
    m = rows.shape[-1]
    rank_norm = stable_ranks(rows.abs()).float() / float(max(m - 1, 1))
    p = torch.tensor(density - epsilon, dtype=torch.float32) + rank_norm * 2 * epsilon
    bits = bits_of(seed, name, term, delta.numel()).double()
    return (bits < p.reshape(-1).double() * SCALE).view(delta.shape)


@dataclass(frozen=True)
class Merge:
    consensus: bool
    normalize: bool
    rescale: bool
    lambda_: float = 1.0


def rescaled(delta: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """δ·mask, times ‖δ‖₁ / ‖δ·mask‖₁ (float32 norms of the exact sums) unless one is < 1e-7."""
    kept = delta * mask.float()
    before = delta.double().abs().sum().float()
    after = kept.double().abs().sum().float()
    if before < 1e-7 or after < 1e-7:
        return kept
    return kept * (before / after)


def sparse_merge(
    base: torch.Tensor,
    models: Sequence[torch.Tensor],
    weights: Sequence[float],
    masks: Sequence[torch.Tensor | None],
    how: Merge,
) -> torch.Tensor:
    """mergekit's generalized task arithmetic for one tensor, float32, not rounded. A mask of
    None keeps every entry (density 1)."""
    b = base.float()
    weighted = []
    for model, weight, mask in zip(models, weights, masks, strict=True):
        delta = model.float() - b
        if mask is not None:
            delta = rescaled(delta, mask) if how.rescale else delta * mask.float()
        weighted.append(delta * torch.tensor(weight, dtype=torch.float32))
    total = torch.zeros_like(b)
    for d in weighted:
        total = total + d
    if how.consensus:
        up = total >= 0
        mixed, divisor = torch.zeros_like(b), torch.zeros_like(b)
        for d, weight in zip(weighted, weights, strict=True):
            agree = torch.where(up, d > 0, d < 0).float()
            mixed = mixed + d * agree
            divisor = divisor + torch.tensor(weight, dtype=torch.float32) * agree
        divisor = torch.where(divisor == 0, 1.0, divisor)
    else:
        mixed = total
        divisor = torch.zeros((), dtype=torch.float32)
        for weight in weights:
            divisor = divisor + torch.tensor(weight, dtype=torch.float32)
        divisor = torch.where(divisor.abs() < 1e-8, 1.0, divisor)
    if how.normalize:
        mixed = mixed / divisor
    if how.lambda_ != 1.0:
        mixed = mixed * torch.tensor(how.lambda_, dtype=torch.float32)
    return b + mixed


def tie_ambiguous(delta: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """The entries whose breadcrumbs fate depends on how a sort orders equal |δ|: those whose
    |δ| equals a value that sits on both sides of a cut (mergekit's sort is not stable)."""
    magnitude = delta.abs().reshape(-1)
    n = magnitude.numel()
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    ordered = magnitude.sort().values
    ambiguous = torch.zeros(n, dtype=torch.bool)
    for cut in (bottom, bottom + target):
        if 0 < cut < n and ordered[cut - 1] == ordered[cut]:
            ambiguous |= magnitude == ordered[cut]
    return ambiguous.view(delta.shape)


def gradient(anchors: Sequence[float], layer: int | None, num_layers: int) -> float:
    """A gradient's value at a layer, as mergekit spreads it (non-layer tensors at 0)."""
    at = 0.0 if layer is None else layer / (num_layers - 1)
    scaled = at * (len(anchors) - 1)
    low = math.floor(scaled)
    high = min(len(anchors) - 1, low + 1)
    fraction = scaled - low
    return (1 - fraction) * anchors[low] + fraction * anchors[high]


def setting_value(setting: Any, name: str, num_layers: int) -> float:
    """A setting's value for tensor `name`, as mergekit resolves it: a number, a gradient over
    the layers, or the first `{filter, value}` whose filter is in the name (or absent)."""
    if isinstance(setting, float | int):
        return float(setting)
    if isinstance(setting[0], dict):
        chosen = next(c for c in setting if c.get("filter") in (None, "*") or c["filter"] in name)
        return setting_value(chosen["value"], name, num_layers)
    return gradient(setting, layer_of(name), num_layers)
