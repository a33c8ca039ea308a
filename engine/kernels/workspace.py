"""Buffers a merge reuses from chunk to chunk and tensor to tensor, instead of allocating anew.

Fresh chunk-sized buffers per chunk fragment the C library's heap as soon as anything small
allocated between them outlives them (a per-chunk statistic kept for the end of a pass, a
tensor's bookkeeping): each freed buffer is left split, a hole a little too small for the next
buffer of its size, which then comes from the top of the heap. Measured on slerp's two passes
over a 64000×2048 BF16 embedding in 2M-element chunks: 1.6 GB of RSS with 0.1 GB in use, the
rest in holes of 4-8 MB, about one per chunk. A buffer taken once and kept is never freed, so
nothing is left to split.
"""

from __future__ import annotations

import torch


class Workspace:
    """Named buffers on one device, each grown to the largest size asked of it and kept."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def take(self, name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A 1-D tensor of `numel` elements, uninitialised, overwritten by the next `take` of
        the same name and dtype."""
        buffer = self._buffers.get((name, dtype))
        if buffer is None or buffer.numel() < numel:
            self._buffers.pop((name, dtype), None)  # freed before its successor is allocated
            buffer = torch.empty(numel, dtype=dtype, device=self.device)
            self._buffers[(name, dtype)] = buffer
        return buffer[:numel]

    def nbytes(self) -> int:
        """Bytes held by all buffers (what a merge keeps besides its chunks in flight)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())
