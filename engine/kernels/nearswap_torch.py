"""nearswap in torch: per element, the model where it lies close to the base, the base where
they are far apart. Elementwise, so a chunk at a time, with mergekit 0.1.5's float32 steps."""

from __future__ import annotations

import torch

from engine.kernels.interpolation_torch import Read
from engine.plan.model import TensorPlan

NEAR_FLOOR = 1e-6  # a smaller |base − model| counts as this: identical entries take the model


def nearswap(read: Read, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
    """Terms (base, 1), (model, 1), scalars["t"]: w = clamp(t / max(|base − model|, 1e-6),
    0, 1) and out = w·model + (1 − w)·base. `t / x` is torch's reciprocal(x)·t, as mergekit's
    arithmetic on a tensor divides a number by it."""
    base = read(tensor.terms[0].source, start, count)
    model = read(tensor.terms[1].source, start, count)
    t = dict(tensor.scalars)["t"]
    # mergekit's steps, each rounded as it rounds them, in place: two temporaries, not eight
    weight = (base - model).abs_().clamp_(min=NEAR_FLOOR).reciprocal_().mul_(t).clamp_(0, 1)
    kept = weight * model
    return kept.add_(weight.neg_().add_(1).mul_(base))  # w·model + (1 − w)·base
