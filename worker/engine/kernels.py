"""The arithmetic: turns one planned tensor into output bytes, a chunk of elements at a time.

Linear ops accumulate in float32 (float64 for F64 inputs) in term order and round once to the
output dtype. TIES needs each delta's magnitude threshold over the whole tensor first; for
tensors larger than a chunk it is found exactly by a two-pass radix select, so memory stays
bounded by the chunk size.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from worker.engine.plan import Plan, TensorPlan, TiesSettings
from worker.engine.tensor_io import TORCH_DTYPES, read_elements

ChunkSource = Callable[[], Iterator[torch.Tensor]]


class Kernels:
    def __init__(self, plan: Plan, *, device: torch.device, chunk_elements: int) -> None:
        self.plan = plan
        self.device = device
        self.chunk_elements = chunk_elements

    def chunks(self, tensor: TensorPlan) -> Iterator[torch.Tensor]:
        """Output chunks (CPU tensors of the output dtype) covering the tensor in order."""
        numel = math.prod(tensor.shape)
        thresholds = self._ties_thresholds(tensor) if tensor.op == "ties" else []
        for start in range(0, numel, self.chunk_elements):
            count = min(self.chunk_elements, numel - start)
            if tensor.op == "ties":
                out = self._ties(tensor, thresholds, start, count)
            else:
                out = self._linear(tensor, start, count)
            yield out.to(TORCH_DTYPES[tensor.dtype]).cpu()

    def _read(self, source: int, name: str, start: int, count: int) -> torch.Tensor:
        checkpoint = self.plan.checkpoints[source]
        raw = read_elements(checkpoint, checkpoint.tensors[name], start, count)
        wide = torch.float64 if raw.dtype == torch.float64 else torch.float32
        return raw.to(self.device).to(wide)

    def _linear(self, tensor: TensorPlan, start: int, count: int) -> torch.Tensor:
        acc: torch.Tensor | None = None
        for term in tensor.terms:
            x = self._read(term.source, tensor.name, start, count)
            if term.coefficient != 1.0:
                x.mul_(term.coefficient)
            acc = x if acc is None else acc.add_(x)
        assert acc is not None
        return acc

    def _ties_settings(self) -> TiesSettings:
        assert self.plan.ties is not None
        return self.plan.ties

    def _deltas(self, tensor: TensorPlan, source: int) -> ChunkSource:
        base = self._ties_settings().base

        def chunks() -> Iterator[torch.Tensor]:
            numel = math.prod(tensor.shape)
            for start in range(0, numel, self.chunk_elements):
                count = min(self.chunk_elements, numel - start)
                x = self._read(source, tensor.name, start, count)
                yield x.sub_(self._read(base, tensor.name, start, count)).abs_()

        return chunks

    def _ties_thresholds(self, tensor: TensorPlan) -> list[float]:
        density = self._ties_settings().density
        if density >= 1.0:
            return [0.0] * len(tensor.terms)
        numel = math.prod(tensor.shape)
        k = max(1, math.ceil(density * numel))
        return [kth_largest(self._deltas(tensor, t.source), numel, k) for t in tensor.terms]

    def _ties(
        self, tensor: TensorPlan, thresholds: list[float], start: int, count: int
    ) -> torch.Tensor:
        settings = self._ties_settings()
        base = self._read(settings.base, tensor.name, start, count)
        weighted = []
        for term, threshold in zip(tensor.terms, thresholds, strict=True):
            delta = self._read(term.source, tensor.name, start, count).sub_(base)
            delta.masked_fill_(delta.abs() < threshold, 0.0)
            weighted.append(delta.mul_(term.coefficient))
        elected = torch.where(torch.stack(weighted).sum(0) >= 0, 1.0, -1.0).to(base.dtype)
        mixed = torch.zeros_like(base)
        divisor = torch.zeros_like(base)
        for term, w in zip(tensor.terms, weighted, strict=True):
            agree = torch.sign(w) == elected
            mixed.add_(torch.where(agree, w, 0.0))
            divisor.add_(agree.to(base.dtype).mul_(term.coefficient))
        if settings.normalize:
            mixed.div_(divisor.masked_fill_(divisor == 0, 1.0))
        if settings.lambda_ != 1.0:
            mixed.mul_(settings.lambda_)
        return base.add_(mixed)


def kth_largest(chunks: ChunkSource, numel: int, k: int) -> float:
    """The k-th largest of non-negative floats produced by `chunks` (callable more than once).

    Small inputs use kthvalue directly; larger ones a two-pass radix select on the float32
    bit patterns (monotonic for non-negative floats), which reads the data twice but never
    holds more than one chunk.
    """
    pieces = list(_take(chunks(), 2))
    if len(pieces) == 1:
        values = pieces[0].to(torch.float32)
        return float(values.kthvalue(numel - k + 1).values)
    high_bin, remaining = _select_bin(chunks, k, lambda bits: bits >> 16)
    low_bin, _ = _select_bin(
        chunks, remaining, lambda bits: (bits & 0xFFFF)[(bits >> 16) == high_bin]
    )
    bits = torch.tensor([(high_bin << 16) | low_bin], dtype=torch.int32)
    return float(bits.view(torch.float32)[0])


def _take(iterator: Iterator[torch.Tensor], n: int) -> Iterator[torch.Tensor]:
    for i, item in enumerate(iterator):
        if i >= n:
            return
        yield item


def _select_bin(
    chunks: ChunkSource, k: int, key: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[int, int]:
    """Histogram 16-bit keys; return the bin holding the k-th largest and k within that bin."""
    histogram: torch.Tensor | None = None
    for chunk in chunks():
        bits = chunk.to(torch.float32).view(torch.int32)
        counts = torch.bincount(key(bits).to(torch.int64), minlength=1 << 16).cpu()
        histogram = counts if histogram is None else histogram.add_(counts)
    assert histogram is not None
    from_top = histogram.flip(0).cumsum(0)
    position = int(torch.searchsorted(from_top, k))
    above = int(from_top[position - 1]) if position > 0 else 0
    return (1 << 16) - 1 - position, k - above
