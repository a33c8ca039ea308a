"""Progress reports and cancellation hooks shared by the engine and its callers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    stage: str  # planning, merging, finalizing
    bytes_done: int
    bytes_total: int
    tensors_done: int
    tensors_total: int
    elapsed_s: float

    @property
    def fraction(self) -> float:
        return self.bytes_done / self.bytes_total if self.bytes_total else 0.0

    @property
    def eta_s(self) -> float | None:
        if self.bytes_done <= 0 or self.bytes_done >= self.bytes_total:
            return None
        return self.elapsed_s * (self.bytes_total - self.bytes_done) / self.bytes_done


ProgressCallback = Callable[[Progress], None]
CancelCheck = Callable[[], bool]
