"""The delta analysis's files: `analysis.json` and `heatmap.png`, side by side."""

from __future__ import annotations

import json
from pathlib import Path

from engine.analysis.heatmap import plot_heatmap
from engine.analysis.result import AnalysisResult


def write_analysis(result: AnalysisResult, out_dir: Path) -> list[Path]:
    """Write `analysis.json` (sorted keys) and `heatmap.png` into `out_dir`; their paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / "analysis.json"
    text = json.dumps(result.to_json(), indent=2, sort_keys=True, allow_nan=False)
    json_path.write_text(text + "\n", encoding="utf-8")
    png_path = plot_heatmap(result, out_dir / "heatmap.png")
    return [json_path, png_path]
