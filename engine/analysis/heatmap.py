"""The delta-analysis heatmap (paper Fig. 2/4): layers up the y axis, parameter kinds across.

matplotlib is imported lazily and driven through its object API with the Agg canvas, so no
global backend is switched and nothing needs a display.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from engine.analysis.result import AnalysisResult, ExpertDelta


def _grid(delta: ExpertDelta) -> list[list[float]]:
    return [[math.nan if v is None else v for v in row] for row in delta.fraction]


def _size(result: AnalysisResult) -> tuple[float, float]:
    width = len(result.experts) * (1.6 + 0.4 * max(len(result.kinds), 4))
    height = min(16.0, max(3.8, 2.2 + 0.28 * result.layers))
    return width, height


def _draw_boundaries(ax: Any, result: AnalysisResult) -> None:
    """Horizontal lines between the suggested language layers and the task layers."""
    suggestion = result.suggestion
    if suggestion is None:
        return
    lines = [(suggestion.bottom, suggestion.bottom - 0.5, "bottom")]
    lines.append((suggestion.top, result.layers - suggestion.top - 0.5, "top"))
    for count, y, name in lines:
        if count == 0:
            continue  # a line on the frame would hide nothing useful; the title says 0
        label = f"{name}={count}"
        ax.axhline(y, color="white", linewidth=2.0, linestyle="--")
        ax.annotate(
            label, xy=(1.0, y), xycoords=("axes fraction", "data"), xytext=(3, 0),
            textcoords="offset points", va="center", fontsize=7,
        )  # fmt: skip


def _draw_expert(fig: Any, ax: Any, result: AnalysisResult, delta: ExpertDelta) -> None:
    image = ax.imshow(
        _grid(delta), origin="lower", aspect="auto", vmin=0.0, vmax=1.0,
        cmap="viridis", interpolation="nearest",
    )  # fmt: skip
    ax.set_xticks(range(len(result.kinds)), result.kinds, rotation=60, ha="right", fontsize=8)
    step = max(1, math.ceil(result.layers / 24))
    ax.set_yticks(range(0, result.layers, step))
    ax.set_xlabel("parameter kind")
    ax.set_ylabel("layer")
    ax.set_title(f"{delta.label} (m={delta.magnitude:.3g})", fontsize=10)
    _draw_boundaries(ax, result)
    fig.colorbar(image, ax=ax, label="fraction of rows > threshold", fraction=0.08)


def plot_heatmap(result: AnalysisResult, path: Path) -> Path:
    """One heatmap per expert: colour = fraction of rows whose MAV exceeds the threshold."""
    # matplotlib: heavy; loaded when a heatmap is drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=_size(result), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(result.experts), squeeze=False)[0]
    for ax, delta in zip(axes, result.experts, strict=True):
        _draw_expert(fig, ax, result, delta)
    title = f"colour: fraction of rows whose MAV vs base > {result.threshold:.3g}"
    if (s := result.suggestion) is not None:
        title += (
            f"\nheuristic swap suggestion (task={s.task}, language={s.language}): "
            f"bottom={s.bottom}, top={s.top} (dashed lines)"
        )
    fig.suptitle(title, fontsize=10)
    fig.savefig(path, dpi=110, metadata={"Software": None})
    return path
