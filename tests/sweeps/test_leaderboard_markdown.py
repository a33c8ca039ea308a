"""The leaderboard's Markdown carries the `experts` baseline the JSON has: each expert's own
score, the bar a merge has to clear."""

from __future__ import annotations

from typing import Any

from service.sweeps.leaderboard import to_markdown


def board(experts: dict[str, float]) -> dict[str, Any]:
    """A leaderboard as `leaderboard()` answers it: two configurations over one pair."""
    best = {
        "config": "b=1 u=1",
        "rank": 1,
        "mean": 0.625,
        "min": 0.625,
        "max": 0.625,
        "stderr": 0.1,
        "ci95": [0.429, 0.821],
        "pairs_scored": 1,
        "vs_best": None,
    }
    other = {**best, "config": "soup", "rank": 2, "mean": 0.5, "min": 0.5, "max": 0.5,
             "vs_best": {"p_value": 0.5, "distinguishable": False}}  # fmt: skip
    return {"objective": {"task": "mgsm_sw", "metric": "exact_match", "filter": None},
            "pairs": 1, "rows": [best, other], "experts": experts}  # fmt: skip


def test_the_markdown_lists_the_experts_own_scores() -> None:
    text = to_markdown(board({"math": 0.375, "hf://team-a/swh@0123abcd": 0.25}))
    assert "| 1 | b=1 u=1 | 0.6250 |" in text and "| 2 | soup | 0.5000 |" in text
    lines = text.splitlines()
    header = lines.index("| expert | score |")
    assert lines[header + 2 :] == ["| math | 0.3750 |", "| hf://team-a/swh@0123abcd | 0.2500 |"]


def test_without_the_experts_baseline_there_is_no_experts_table() -> None:
    text = to_markdown(board({}))
    assert "| expert |" not in text and text.endswith(
        "| soup | 0.5000 | 0.5000 | 0.5000 | 0.1000 | [0.4290, 0.8210] | 0.5 | no |\n"
    )
