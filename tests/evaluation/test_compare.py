"""The paired noise test on constructed per-sample results, its p-values checked against
scipy's exact binomial test (an independent implementation); per-sample records as stored,
read per metric."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from scipy.stats import binomtest

from core.evaluation.compare import mcnemar_exact, paired
from core.evaluation.results import outcomes as read_outcomes
from core.evaluation.results import read_samples, sample_records, write_samples

DOCUMENTS = 250  # MGSM's documents per language


def outcomes(right: set[int]) -> dict[int, bool]:
    return {d: d in right for d in range(DOCUMENTS)}


def test_a_few_points_on_mgsm_with_many_disagreements_is_noise() -> None:
    # 4 points apart (62 % vs 58 %), but the models disagree on 50 documents: 30 to 20.
    first = outcomes(set(range(0, 125)) | set(range(200, 230)))
    second = outcomes(set(range(0, 125)) | set(range(230, 250)))
    result = paired(first, second)
    assert result is not None
    assert (result.only_first, result.only_second) == (30, 20)
    assert result.difference == pytest.approx(10 / DOCUMENTS)
    assert result.p_value == pytest.approx(binomtest(20, 50, 0.5).pvalue)
    assert not result.significant


def test_the_same_gap_without_disagreement_noise_is_real() -> None:
    # 4 points apart too, but every disagreement goes one way: 10 to 0.
    first = outcomes(set(range(0, 155)))
    second = outcomes(set(range(0, 145)))
    result = paired(first, second)
    assert result is not None and (result.only_first, result.only_second) == (10, 0)
    assert result.p_value == pytest.approx(binomtest(0, 10, 0.5).pvalue)
    assert result.significant


def test_only_documents_scored_for_both_count() -> None:
    first = {0: True, 1: True, 2: False}
    second = {1: False, 2: True, 3: True}
    result = paired(first, second)
    assert result is not None and result.documents == 2
    assert (result.only_first, result.only_second) == (1, 1)
    assert paired({0: True}, {1: True}) is None


@pytest.mark.parametrize("seed", range(5))
def test_p_values_match_the_exact_binomial_test(seed: int) -> None:
    rng = random.Random(seed)
    a, b = rng.randrange(0, 60), rng.randrange(0, 60)
    assert mcnemar_exact(a, b) == pytest.approx(binomtest(min(a, b), a + b, 0.5).pvalue)
    assert mcnemar_exact(0, 0) == 1.0


def lm_eval_samples(acc: list[float], acc_norm: list[float]) -> dict[str, Any]:
    """lm-eval's output for a multiple-choice task scored by acc and acc_norm, per document."""
    return {
        "samples": {
            "choice": [
                {"doc_id": d, "filter": "none", "metrics": ["acc", "acc_norm"], "acc": a,
                 "acc_norm": n, "arguments": [["Q?", " a"]], "resps": [[(-1.0, False)]],
                 "filtered_resps": [(-1.0, False)], "target": 0}
                for d, (a, n) in enumerate(zip(acc, acc_norm, strict=True))
            ]
        }
    }  # fmt: skip


def test_records_keep_each_metric_and_outcomes_read_the_one_asked(tmp_path: Path) -> None:
    written = sample_records(lm_eval_samples([1.0, 0.0, 1.0], [0.0, 0.0, 1.0]))
    write_samples(written, tmp_path / "samples.jsonl")
    stored = read_samples(tmp_path / "samples.jsonl")
    assert [r["metrics"] for r in stored] == [
        {"acc": 1.0, "acc_norm": 0.0}, {"acc": 0.0, "acc_norm": 0.0}, {"acc": 1.0, "acc_norm": 1.0}
    ]  # fmt: skip
    assert [r["correct"] for r in stored] == [True, False, True]  # the first metric's
    where = {"task": "choice", "filter": "none"}
    assert read_outcomes(stored, **where, metric="acc") == {0: True, 1: False, 2: True}
    assert read_outcomes(stored, **where, metric="acc_norm") == {0: False, 1: False, 2: True}
    assert read_outcomes(stored, task="other", filter="none", metric="acc") == {}
    assert read_outcomes(stored, task="choice", filter="strict", metric="acc") == {}


def test_no_outcomes_where_the_metric_is_not_right_or_wrong_per_document() -> None:
    where = {"task": "t", "filter": "none", "doc_id": 0}
    f1 = [{**where, "metrics": {"f1": 0.5, "exact_match": 1}, "correct": True}]
    assert read_outcomes(f1, task="t", filter="none", metric="f1") is None
    assert read_outcomes(f1, task="t", filter="none", metric="exact_match") == {0: True}
    pair = [{**where, "metrics": {"brier_score": [0, [0.7, 0.3]]}, "correct": None}]
    assert read_outcomes(pair, task="t", filter="none", metric="brier_score") is None
    # Records without `metrics` (`correct` only) do not say which metric `correct` measured.
    legacy = [{**where, "correct": True}, {**where, "doc_id": 1, "correct": False}]
    assert read_outcomes(legacy, task="t", filter="none", metric="acc") is None
    # A metric the records lack for one document: no partial test either.
    partial = [{**where, "metrics": {"acc": 1.0}}, {**where, "doc_id": 1, "metrics": {}}]
    assert read_outcomes(partial, task="t", filter="none", metric="acc") is None
    flags = [{**where, "metrics": {"exact_match": True}}]
    assert read_outcomes(flags, task="t", filter="none", metric="exact_match") == {0: True}
