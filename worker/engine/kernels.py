"""The arithmetic: turns one planned tensor into output bytes, a chunk of elements at a time.

Linear ops accumulate in float32 (float64 for F64 inputs) in term order and round once to the
output dtype. TIES first selects each delta's top-k over the whole tensor (selection.py),
then combines chunk by chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from worker.engine.plan import Plan, TensorPlan, TiesSettings
from worker.engine.selection import ChunkSource, TopK, top_k, trim
from worker.engine.tensor_io import TORCH_DTYPES, read_elements


class Kernels:
    def __init__(
        self,
        plan: Plan,
        *,
        device: str,
        chunk_elements: int,
        check_cancel: Callable[[], None] | None = None,
    ) -> None:
        self.plan = plan
        # Raises when the merge is canceled; called per chunk of TIES's top-k passes, which read
        # a whole tensor several times before its first output byte.
        self.check_cancel = check_cancel or (lambda: None)
        self.device = torch.device(device)
        self.chunk_elements = chunk_elements
        # TIES makes a dozen float32 temporaries per chunk: a quarter chunk keeps them in the
        # CPU's cache (measured: about 1.5x faster than half chunks) and memory low.
        self.ties_chunk_elements = max(1, chunk_elements // 4)
        # Top-k selection holds one |δ| chunk: whole tensors up to 2 chunks in memory.
        self.selection_elements = 2 * chunk_elements

    def chunks(self, tensor: TensorPlan) -> Iterator[torch.Tensor]:
        """Output chunks (CPU tensors of the output dtype) covering the tensor in order."""
        numel = math.prod(tensor.shape)
        selections = self._ties_selections(tensor) if tensor.op == "ties" else []
        ties_left = [top.ties if top else 0 for top in selections]
        step = self.ties_chunk_elements if tensor.op == "ties" else self.chunk_elements
        for start in range(0, numel, step):
            count = min(step, numel - start)
            if tensor.op == "ties":
                out = self._ties(tensor, selections, ties_left, start, count)
            else:
                out = self._linear(tensor, start, count)
            yield out.to(TORCH_DTYPES[tensor.dtype]).cpu()

    @staticmethod
    def as_bytes(chunk: torch.Tensor) -> memoryview:
        """The chunk's bytes, without a copy."""
        return chunk.view(-1).view(torch.uint8).numpy().data

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

    def _magnitudes(self, tensor: TensorPlan, source: int) -> ChunkSource:
        """|T_source − base| of the whole tensor, in chunks that still fit in memory."""
        base = self._ties_settings().base

        def chunks() -> Iterator[torch.Tensor]:
            numel = math.prod(tensor.shape)
            step = self.selection_elements
            for start in range(0, numel, step):
                self.check_cancel()
                count = min(step, numel - start)
                x = self._read(source, tensor.name, start, count)
                yield x.sub_(self._read(base, tensor.name, start, count)).abs_()

        return chunks

    def _ties_selections(self, tensor: TensorPlan) -> list[TopK | None]:
        density = self._ties_settings().density
        if density >= 1.0:
            return [None] * len(tensor.terms)
        k = max(1, math.ceil(density * math.prod(tensor.shape)))
        return [top_k(self._magnitudes(tensor, t.source), k) for t in tensor.terms]

    def _ties(
        self, tensor: TensorPlan, selections: list[TopK | None], ties_left: list[int],
        start: int, count: int,
    ) -> torch.Tensor:  # fmt: skip
        """base + the disjoint mean of the trimmed, weighted deltas that agree with the sign
        of their sum. The agreeing sum is the sum of the positive parts where that sum is
        ≥ 0, of the negative parts elsewhere (and likewise the divisor): one pass per input,
        fewer temporaries than electing first and masking each input after."""
        settings = self._ties_settings()
        base = self._read(settings.base, tensor.name, start, count)
        positive = negative = up = down = torch.empty(0)
        for i, (term, top) in enumerate(zip(tensor.terms, selections, strict=True)):
            delta = self._read(term.source, tensor.name, start, count).sub_(base)
            if top is not None:
                delta, ties_left[i] = trim(delta, top, ties_left[i])
            if term.coefficient != 1.0:
                delta.mul_(term.coefficient)
            above, below = delta > 0, delta < 0
            if i == 0:
                positive, negative = delta.clamp_min(0.0), delta.clamp_max_(0.0)
                up = above.to(base.dtype).mul_(term.coefficient)
                down = below.to(base.dtype).mul_(term.coefficient)
            else:
                positive.add_(delta.clamp_min(0.0))
                negative.add_(delta.clamp_max_(0.0))
                up.add_(above, alpha=term.coefficient)
                down.add_(below, alpha=term.coefficient)
        elected_up = (positive + negative) >= 0
        mixed = torch.where(elected_up, positive, negative)
        if settings.normalize:
            divisor = torch.where(elected_up, up, down)
            mixed.div_(divisor.masked_fill_(divisor == 0, 1.0))
        if settings.lambda_ != 1.0:
            mixed.mul_(settings.lambda_)
        return base.add_(mixed)
