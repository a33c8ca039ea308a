"""The leaderboard's test against the best configuration reads the objective's own metric in
each pair's stored per-sample records (acc and acc_norm disagree on these documents)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from core.evaluation.results import sample_records, write_samples
from service.sweeps.leaderboard import _versus
from tests.evaluation.test_compare import lm_eval_samples
from tests.service.conftest import make_settings

TENANT = "default"


def test_the_comparison_with_the_best_reads_the_objectives_metric(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}")
    # Two pairs; per document (acc, acc_norm) of the best configuration and of another.
    measured = {
        ("best", 0): ([1.0, 1.0, 0.0], [1.0, 1.0, 1.0]),
        ("best", 1): ([1.0, 0.0, 0.0], [1.0, 1.0, 0.0]),
        ("other", 0): ([1.0, 1.0, 0.0], [0.0, 0.0, 1.0]),
        ("other", 1): ([1.0, 0.0, 0.0], [1.0, 0.0, 0.0]),
    }
    for (config, pair), (acc, acc_norm) in measured.items():
        path = settings.evaluations_dir / TENANT / f"{config}-{pair}" / "samples.jsonl"
        write_samples(sample_records(lm_eval_samples(acc, acc_norm)), path)

    def cells(config: str, metric: str) -> dict[int, dict[str, Any]]:
        return {
            pair: {"job_id": f"{config}-{pair}", "task": "choice", "filter": "none",
                   "metric": metric}
            for pair in (0, 1)
        }  # fmt: skip

    by_acc = _versus(settings, TENANT, cells("other", "acc"), cells("best", "acc"))
    assert by_acc is not None
    assert (by_acc["only_first"], by_acc["only_second"], by_acc["documents"]) == (0, 0, 6)
    by_norm = _versus(settings, TENANT, cells("other", "acc_norm"), cells("best", "acc_norm"))
    assert by_norm is not None
    assert (by_norm["only_first"], by_norm["only_second"], by_norm["documents"]) == (0, 3, 6)
    assert not by_norm["distinguishable"]  # 3 to 0 on 6 documents: p = 0.25
    brier = _versus(settings, TENANT, cells("other", "brier_score"), cells("best", "acc"))
    assert brier is None  # the records keep no brier_score right/wrong: no test
