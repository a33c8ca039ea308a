"""The compiled bf16/fp16 task arithmetic and TIES (engine/kernels/narrow.py) against the torch
operations they fuse (narrow_torch.NarrowTaskVectors.chunk, mergekit's own steps): the same bits
on random deltas with the awkward cases in them: signed zeros, tied magnitudes at the cut,
sums that cancel or underflow in fp16, NaN-free extremes."""

from __future__ import annotations

import math

import pytest
import torch

from engine.kernels.narrow_torch import NarrowTaskVectors, sorted_mask
from engine.kernels.top_k import top_k
from engine.plan.model import TensorPlan, Term, TiesSettings

COUNT = 4096


def inputs(dtype: torch.dtype, models: int, seed: int) -> list[torch.Tensor]:
    """A base and `models` fine-tunes: small deltas, some exactly zero or cancelling."""
    generator = torch.Generator().manual_seed(seed)
    base = torch.randn(COUNT, generator=generator) * 0.02
    base[:64] = 0.0
    base[64:96] = -0.0
    found = [base.to(dtype)]
    for i in range(models):
        delta = torch.randn(COUNT, generator=generator) * 1e-3 * (i + 1)
        delta[::7] = 0.0
        delta[::11] = 1e-8 if dtype == torch.float16 else 1e-30  # underflows
        delta[100:200] = (-1) ** i * 5e-4  # cancels between models: ties and elections
        found.append((base + delta).to(dtype))
    return found


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("op", "weights", "density", "normalize", "lambda_", "sorted_"),
    [("task_arithmetic", [0.7, -0.3, 0.45], 1.0, True, 1.3, False),
     ("task_arithmetic", [1.0, 1.0], 1.0, False, 1.0, False),
     ("ties", [0.7, 0.3, 0.5], 0.5, True, 1.2, False),
     ("ties", [1.0, 0.6], 0.3, False, 1.0, True),
     ("ties", [0.2, 1.0, 0.9], 1.0, True, 0.8, False)],
)  # fmt: skip
def test_the_compiled_kernel_is_torchs_bit_for_bit(
    dtype: torch.dtype, op: str, weights: list[float], density: float, normalize: bool,
    lambda_: float, sorted_: bool,
) -> None:  # fmt: skip
    xs = inputs(dtype, len(weights), seed=len(weights) + int(density * 10))
    terms = tuple(Term(i + 1, w) for i, w in enumerate(weights))
    tensor = TensorPlan("t", (COUNT,), "BF16", op, terms, 0, op)  # type: ignore[arg-type]
    settings = TiesSettings(0, density, lambda_, normalize)

    def read(source: int, start: int, count: int) -> torch.Tensor:
        return xs[source][start : start + count].clone()

    def magnitudes(source: int) -> list[torch.Tensor]:
        return [(xs[source] - xs[0]).abs().float()]

    selections = [None] * len(weights)
    if op == "ties" and density < 1.0:
        k = settings.kept(COUNT)
        selections = [
            sorted_mask(magnitudes(t.source), COUNT, (0, k), descending=True) if sorted_
            else top_k(lambda t=t: iter(magnitudes(t.source)), k, numel=COUNT, in_memory=COUNT)
            for t in terms
        ]  # fmt: skip
    reference = NarrowTaskVectors(read, tensor, settings, list(selections))
    compiled = NarrowTaskVectors(read, tensor, settings, list(selections))
    for start in range(0, COUNT, 1000):  # chunks in order: the tie quotas carry over
        count = min(1000, COUNT - start)
        expected, got = reference.chunk(start, count), compiled.compiled_chunk(start, count)
        assert got.dtype == expected.dtype == dtype
        assert torch.equal(got.view(torch.int16), expected.view(torch.int16)), start
    assert compiled.ties_left == reference.ties_left
    assert not math.isnan(float(got.float().sum()))
