"""Progress moves as the bytes are written: a layer swap of a checkpoint with a few large
tensors (large computed embeddings and head, laid out before the copied layers by name, so the
writer waits for them) reports progress at least every few percent of its bytes, not once at
the end of each computed tensor."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.progress import Progress
from tests.helpers import stringify

# Of the output's bytes, between two consecutive reports: 33 MB here, 4 of the writer's blocks.
MAX_STEP = 0.06


@pytest.fixture(scope="module")
def large_experts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two float32 Llama experts of about 530 MB each: 4 layers of 36 MB, embeddings and
    lm_head of 192 MB each."""
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("large")
    task = make_checkpoint(
        root / "task", layers=4, hidden=1024, intermediate=2048, vocab=49152,
        heads=4, kv_heads=2, dtype=torch.float32, seed=1,
    )  # fmt: skip
    language = make_checkpoint(root / "language", base=task, dtype=torch.float32, seed=2,
                               non_layer_scale=0.03)  # fmt: skip
    return task, language


def test_progress_moves_every_few_percent_of_the_bytes(
    large_experts: tuple[Path, Path], tmp_path: Path
) -> None:
    from engine.merge import MergeOptions, merge
    from engine.recipe import parse_recipe

    task, language = large_experts
    recipe: dict[str, Any] = {
        "method": "layer_swap",
        "experts": {"task": [task], "language": [language]},
        "params": {"bottom": 1, "top": 1, "non_layer": "average"},
    }
    reports: list[Progress] = []
    merge(
        parse_recipe(stringify(recipe)),
        tmp_path / "out",
        resolve=Path,
        options=MergeOptions(durable=False),
        on_progress=reports.append,
    )
    total = reports[-1].bytes_total
    assert total > 500_000_000
    done = [0, *(r.bytes_done for r in reports), total]
    assert done == sorted(done)  # never backwards
    assert reports[-1].bytes_done == total
    steps = [b - a for a, b in itertools.pairwise(done)]
    assert max(steps) <= MAX_STEP * total, f"progress jumped {max(steps) / total:.0%} at once"
