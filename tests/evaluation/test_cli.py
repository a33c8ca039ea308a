"""`layerswap evaluate`, run as a real subprocess: the results table holds the scores the
reference computes; bad input is a clear error with a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path

from core.evaluation.random_weights import RANDOM_WEIGHTS_NOTE
from tests.evaluation.conftest import CHOICE_TASK, MAX_GEN_TOKS, TASK, ChoiceTask, Model
from tests.test_cli import layerswap


def table_rows(stdout: str) -> dict[tuple[str, str, str], list[str]]:
    """(task, filter, metric) -> the row's cells."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 7 and cells[0] not in ("Task",) and not set(cells[0]) <= {"-"}:
            rows[(cells[0], cells[1], cells[3])] = cells
    return rows


def test_evaluate_prints_the_scores_and_writes_the_samples(
    tiny_model: Model, choice_task: ChoiceTask, tmp_path: Path
) -> None:
    samples = tmp_path / "samples.jsonl"
    done = layerswap(
        "evaluate", tiny_model.path, "--tasks", f"{CHOICE_TASK},{TASK}", "--num-fewshot", 0,
        "--batch-size", 1, "--max-gen-toks", MAX_GEN_TOKS, "--tasks-dir", choice_task.tasks_dir,
        "--data-dir", tiny_model.data_dir, "--samples", samples, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = table_rows(done.stdout)
    exact = rows[(TASK, "remove_whitespace", "exact_match")]
    assert float(exact[4]) == round(sum(tiny_model.right) / len(tiny_model.right), 4)
    assert exact[2] == "0" and exact[6] == str(len(tiny_model.right))
    assert float(exact[5]) > 0  # the standard error, which lm-eval's table hides in a column
    acc = rows[(CHOICE_TASK, "none", "acc")]
    assert float(acc[4]) == round(sum(choice_task.right) / len(choice_task.right), 4)
    assert "evaluating" in done.stderr  # the progress bar
    assert "random weights" not in done.stdout  # a model made for these answers: no note
    records = [json.loads(line) for line in samples.read_text().splitlines()]
    assert {r["task"] for r in records} == {TASK, CHOICE_TASK}


def test_evaluate_says_why_the_examples_score_0(examples: Path, tmp_path: Path) -> None:
    """The example experts' config.json marks their weights random: the note under the table."""
    done = layerswap(
        "evaluate", examples / "swh", "--tasks", TASK, "--limit", 2, "--num-fewshot", 0,
        "--max-gen-toks", MAX_GEN_TOKS, "--data-dir", examples / "eval-data", "-q", cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert float(table_rows(done.stdout)[(TASK, "remove_whitespace", "exact_match")][4]) == 0
    lines = done.stdout.splitlines()
    last_row = max(i for i, line in enumerate(lines) if line.startswith("|"))
    assert lines[last_row + 1] == RANDOM_WEIGHTS_NOTE, done.stdout  # right under the table


def test_evaluate_refuses_bad_input_clearly(tiny_model: Model, tmp_path: Path) -> None:
    unknown = layerswap("evaluate", tiny_model.path, "--tasks", "mgsm_nope_xx",
                        "--data-dir", tiny_model.data_dir, cwd=tmp_path)  # fmt: skip
    assert unknown.returncode == 1
    assert "error [unknown_task]: tasks.0: unknown task 'mgsm_nope_xx'" in unknown.stderr
    bad_limit = layerswap("evaluate", tiny_model.path, "--tasks", TASK, "--limit", 0, cwd=tmp_path)
    assert bad_limit.returncode == 2 and "limit" in bad_limit.stderr
    no_model = layerswap("evaluate", tmp_path, "--tasks", TASK, "--num-fewshot", 0,
                         "--data-dir", tiny_model.data_dir, cwd=tmp_path)  # fmt: skip
    assert no_model.returncode == 1 and "cannot be loaded as a model" in no_model.stderr
