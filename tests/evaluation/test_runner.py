"""The evaluation runner on a real lm-eval run, checked against the reference in conftest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.evaluation.errors import EvaluationFailed, EvaluationTimeout, UnknownTask
from core.evaluation.runner import evaluate
from core.evaluation.spec import EvaluationSpec
from core.evaluation.tasks import check_tasks
from engine.errors import MergeCanceled
from tests.evaluation.conftest import (
    CHOICE_QUESTIONS,
    CHOICE_TASK,
    MAX_GEN_TOKS,
    QUESTIONS,
    TASK,
    ChoiceTask,
    Model,
    normalise,
)


def spec(**overrides: object) -> EvaluationSpec:
    values: dict[str, object] = {"tasks": [TASK], "num_fewshot": 0, "batch_size": 1,
                                 "max_gen_toks": MAX_GEN_TOKS}  # fmt: skip
    return EvaluationSpec.model_validate({**values, **overrides})


def test_the_stored_accuracy_is_what_the_model_answers(tiny_model: Model, tmp_path: Path) -> None:
    progress: list[tuple[int, int]] = []
    outcome = evaluate(
        tiny_model.path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir,
        cache_prefix=tmp_path / "c", on_progress=lambda d, t: progress.append((d, t)),
    )  # fmt: skip
    exact = {s.filter: s for s in outcome.scores if s.metric == "exact_match"}
    expected = sum(tiny_model.right) / len(QUESTIONS)
    assert exact["remove_whitespace"].value == pytest.approx(expected)
    assert exact["remove_whitespace"].samples == len(QUESTIONS)
    assert exact["remove_whitespace"].num_fewshot == 0
    assert exact["remove_whitespace"].stderr is not None and exact["remove_whitespace"].stderr > 0
    assert progress[0] == (0, len(QUESTIONS)) and progress[-1] == (len(QUESTIONS),) * 2
    records = [r for r in outcome.samples if r["filter"] == "remove_whitespace"]
    assert sorted(r["doc_id"] for r in records) == list(range(len(QUESTIONS)))
    for record in records:
        i = record["doc_id"]
        assert record["prompt"].endswith(f"Swali: {QUESTIONS[i]}\nAnswer:")
        assert record["extracted"] == tiny_model.answers[i]
        assert record["correct"] is tiny_model.right[i]
        assert (
            normalise(record["extracted"]) == normalise(record["target"]) or not record["correct"]
        )
    json.dumps(outcome.samples)  # plain JSON, numpy scalars converted


def test_a_multiple_choice_accuracy_is_what_the_log_likelihoods_say(
    tiny_model: Model, choice_task: ChoiceTask, tmp_path: Path
) -> None:
    """A log-likelihood task from LAYERSWAP_EVAL_TASKS_DIR, next to a generation task."""
    check_tasks([CHOICE_TASK, TASK], choice_task.tasks_dir)
    outcome = evaluate(
        tiny_model.path, spec(tasks=[CHOICE_TASK, TASK]), tasks_dir=choice_task.tasks_dir,
        data_dir=tiny_model.data_dir, cache_prefix=tmp_path / "c",
    )  # fmt: skip
    (acc,) = [s for s in outcome.scores if s.task == CHOICE_TASK and s.metric == "acc"]
    assert acc.value == pytest.approx(sum(choice_task.right) / len(CHOICE_QUESTIONS))
    assert acc.samples == len(CHOICE_QUESTIONS)
    records = sorted(
        (r for r in outcome.samples if r["task"] == CHOICE_TASK), key=lambda r: r["doc_id"]
    )
    assert [r["correct"] for r in records] == choice_task.right
    assert outcome.requests_run == {"loglikelihood": 4 * len(CHOICE_QUESTIONS),
                                    "generate_until": len(QUESTIONS)}  # fmt: skip
    exact = [s for s in outcome.scores if s.task == TASK and s.filter == "remove_whitespace"]
    assert exact[0].value == pytest.approx(sum(tiny_model.right) / len(QUESTIONS))


def test_a_second_run_answers_from_the_request_cache(tiny_model: Model, tmp_path: Path) -> None:
    cache = tmp_path / "cache" / "requests"
    first = evaluate(tiny_model.path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir,
                     cache_prefix=cache)  # fmt: skip
    asked: list[tuple[int, int]] = []
    again = evaluate(
        tiny_model.path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir,
        cache_prefix=cache, on_progress=lambda d, t: asked.append((d, t)),
    )  # fmt: skip
    assert asked == []  # every request was cached: the model was asked for nothing
    assert [s.value for s in again.scores] == [s.value for s in first.scores]


def test_cancel_and_timeout_stop_between_batches(tiny_model: Model, tmp_path: Path) -> None:
    reports: list[int] = []

    def cancel_after_first_batch() -> bool:
        return len(reports) >= 2  # (0, n) and the first batch's report

    with pytest.raises(MergeCanceled):
        evaluate(
            tiny_model.path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir,
            cache_prefix=tmp_path / "c", on_progress=lambda d, t: reports.append(d),
            should_cancel=cancel_after_first_batch,
        )  # fmt: skip
    assert reports == [0, 4]  # batch_size 1: chunks of 4 requests
    with pytest.raises(EvaluationTimeout):
        evaluate(tiny_model.path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir,
                 timeout_s=1e-9)  # fmt: skip


def test_unknown_tasks_and_missing_data_are_clear_errors(tiny_model: Model, tmp_path: Path) -> None:
    with pytest.raises(UnknownTask) as unknown:
        check_tasks([TASK, "mgsm_nonexistent_xx"], None, field="evaluation.tasks")
    assert unknown.value.details == {"field": "evaluation.tasks.1", "task": "mgsm_nonexistent_xx"}
    with pytest.raises(EvaluationFailed) as missing:
        evaluate(tiny_model.path, spec(), tasks_dir=None, data_dir=tmp_path / "empty")
    assert "mgsm/sw/train.jsonl" in missing.value.message
    with pytest.raises(EvaluationFailed) as not_a_model:
        evaluate(tmp_path, spec(), tasks_dir=None, data_dir=tiny_model.data_dir)
    assert "cannot be loaded as a model" in not_a_model.value.message
