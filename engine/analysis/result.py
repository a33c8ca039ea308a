"""The delta analysis's result: plain data and its JSON (deltas.py makes it, files.py
writes it)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUGGESTION_NOTE = (
    "Heuristic, not a measurement of merge quality: bottom/top count the consecutive layers "
    "from each end where the language expert's per-layer score (mean over parameter kinds of "
    "the fraction of rows whose MAV exceeds the threshold) exceeds the task expert's. "
    "Clamped so that at least one layer stays with the task expert. Validate on a benchmark."
)


@dataclass(frozen=True)
class SwapSuggestion:
    """Suggested layer-swap (bottom, top); `raw` is the pair before clamping."""

    task: str
    language: str
    bottom: int
    top: int
    raw: tuple[int, int]
    task_scores: list[float]
    language_scores: list[float]

    def to_json(self) -> dict[str, Any]:
        return {
            "heuristic": True,
            "note": SUGGESTION_NOTE,
            "task": self.task,
            "language": self.language,
            "bottom": self.bottom,
            "top": self.top,
            "clamped": (self.bottom, self.top) != self.raw,
            "unclamped": {"bottom": self.raw[0], "top": self.raw[1]},
            "layer_scores": {"task": self.task_scores, "language": self.language_scores},
        }


@dataclass(frozen=True)
class ExpertDelta:
    """One expert against the base; matrices are [layer][kind], None where a kind is absent."""

    label: str
    path: Path
    fraction: list[list[float | None]]
    mean_mav: list[list[float | None]]
    magnitude: float

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "fraction": self.fraction,
            "mean_mav": self.mean_mav,
            "magnitude": self.magnitude,
        }


@dataclass(frozen=True)
class AnalysisResult:
    base: Path
    threshold: float
    threshold_rule: str
    kinds: list[str]
    layers: int
    experts: list[ExpertDelta]
    suggestion: SwapSuggestion | None

    def expert(self, label: str) -> ExpertDelta:
        for delta in self.experts:
            if delta.label == label:
                return delta
        raise KeyError(label)

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict; `experts` maps each label to its matrices and magnitude."""
        return {
            "base": str(self.base),
            "threshold": self.threshold,
            "threshold_rule": self.threshold_rule,
            "row_definition": "a slice along the last dimension; a 1-D tensor is one row",
            "kinds": list(self.kinds),
            "layers": self.layers,
            "experts": {d.label: d.to_json() for d in self.experts},
            "suggestion": None if self.suggestion is None else self.suggestion.to_json(),
        }
