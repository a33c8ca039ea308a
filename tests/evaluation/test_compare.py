"""The paired noise test on constructed per-sample results, its p-values checked against
scipy's exact binomial test (an independent implementation)."""

from __future__ import annotations

import random

import pytest
from scipy.stats import binomtest

from worker.evaluation.compare import mcnemar_exact, paired

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
