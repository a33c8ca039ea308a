"""Exact top-k selection over a tensor that may be too large to hold: which |δ| TIES keeps.

TIES keeps exactly k entries per tensor (TiesSettings.kept: ⌊density·n⌋, at least one): every
entry above the k-th largest value, plus as many entries equal to it as are still needed, the
first ones in flat order (deterministic, unlike an argsort). Tensors that fit in memory are
gathered into one buffer, chunk by chunk, and numpy partitions it in place (an O(n) select, one
pass over the inputs); larger ones (embeddings) use a two-pass radix select on float32 bit
patterns, which are ordered like the values themselves for non-negative floats, reading one
chunk at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

ChunkSource = Callable[[], Iterator[torch.Tensor]]  # non-negative float32 chunks, repeatable
_BINS = 1 << 16


@dataclass(frozen=True)
class TopK:
    threshold: float  # the k-th largest value
    ties: int  # how many entries equal to threshold are kept, the first in flat order


def top_k(
    chunks: ChunkSource, k: int, *, numel: int, in_memory: int, buffer: torch.Tensor | None = None
) -> TopK:
    """Exact top-k of the `numel` values `chunks` yields: in one buffer when `numel` is at
    most `in_memory` (`buffer`'s first `numel` elements where given, float32 on the CPU: kept
    from call to call, its contents overwritten), else by radix select (`chunks` is then called
    again for a second pass). Narrower floats (bf16, fp16 arithmetic) are widened to float32
    first: exact, same order."""

    def widened() -> Iterator[torch.Tensor]:
        return (c.float() if c.dtype in (torch.bfloat16, torch.float16) else c for c in chunks())

    if numel <= in_memory:
        held = None if buffer is None else buffer[:numel].numpy()
        return _top_k_in_memory(widened, k, numel, held)
    high, above_high, remaining = _select_bin(widened, k, lambda bits: bits >> 16)
    low, above_low, _ = _select_bin(
        widened, remaining, lambda bits: (bits & 0xFFFF)[(bits >> 16) == high]
    )
    pattern = torch.tensor([(high << 16) | low], dtype=torch.int32)
    return TopK(float(pattern.view(torch.float32)[0]), k - above_high - above_low)


def _top_k_in_memory(
    chunks: ChunkSource, k: int, numel: int, values: np.ndarray | None = None
) -> TopK:
    at = 0
    for chunk in chunks():
        part = chunk.cpu().numpy()
        if values is None or values.dtype != part.dtype:
            values = np.empty(numel, dtype=part.dtype)
        values[at : at + part.size] = part
        at += part.size
    assert values is not None and at == numel, (at, numel)
    kth = numel - k
    values.partition(kth)  # in place: [kth] is the k-th largest, everything after it >= it
    threshold = values[kth]
    above = int(np.count_nonzero(values[kth + 1 :] > threshold))
    return TopK(float(threshold), k - above)


def keep_mask(magnitude: torch.Tensor, top: TopK, ties_left: int) -> tuple[torch.Tensor, int]:
    """Mask of the entries of this chunk that are kept, and the tie quota left after it."""
    keep = magnitude > top.threshold
    if ties_left > 0:
        tied = magnitude == top.threshold
        keep |= tied & (tied.cumsum(0) <= ties_left)
        ties_left -= min(ties_left, int(tied.sum()))
    return keep, ties_left


def trim_(delta: torch.Tensor, top: TopK, ties_left: int) -> int:
    """Zero, in place, the entries of this chunk of δ that are not kept; return the tie quota
    left after it. Float arithmetic (see torch_kernels.Kernels._ties): |δ| − threshold has the sign
    of the comparison, so clamp(sign, 0) is the 0/1 keep mask."""
    magnitude = delta.abs()
    if ties_left > 0:
        keep, ties_left = keep_mask(magnitude, top, ties_left)
        delta.mul_(keep.view(torch.uint8).to(delta.dtype))
    else:
        delta.mul_(magnitude.sub_(top.threshold).sign_().clamp_min_(0.0))
    return ties_left


def _select_bin(
    chunks: ChunkSource, k: int, key: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[int, int, int]:
    """Histogram 16-bit keys: (bin of the k-th largest, entries in higher bins, k in the bin)."""
    histogram = torch.zeros(_BINS, dtype=torch.int64)
    for chunk in chunks():
        bits = chunk.to(torch.float32).view(torch.int32)
        histogram += torch.bincount(key(bits), minlength=_BINS).cpu()
    from_top = histogram.flip(0).cumsum(0)
    position = int(torch.searchsorted(from_top, k))
    above = int(from_top[position - 1]) if position > 0 else 0
    return _BINS - 1 - position, above, k - above
