"""A merge's comparison with its inputs on a task scored three ways: acc and acc_norm (0/1 per
document, but not the same 0/1) and brier_score (not 0/1 per document). Each score's paired
test reads that score's own metric in the stored per-sample records; records that do not keep
it give no paired test rather than another metric's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.evaluation.compare import mcnemar_exact
from tests.evaluation.conftest import write_choice_yaml
from tests.service.conftest import Service, layer_swap, running_service

TASK = "tiny_choice_norm"
CHOICES = ["a", "o", "moja", "jibu"]
# (question number, label). On the first nine questions the examples' language expert picks
# another choice than the merge (bottom 1, top 1) by length-normalised log-likelihood
# (acc_norm) while both pick "o" by log-likelihood (acc), each by a clear margin (computed with
# transformers on those models). The labels make the merge alone right by acc_norm on five, the
# expert alone on four, and both right or both wrong by acc everywhere; the last three agree.
ROWS = [(14, 1), (17, 1), (19, 1), (27, 1), (29, 1), (41, 2), (42, 2), (50, 2), (54, 2),
        (11, 1), (12, 1), (21, 0)]  # fmt: skip
EVALUATION = {"tasks": [TASK], "num_fewshot": 0, "batch_size": 1, "dtype": "float32"}


def records(service: Service, job_id: str) -> list[dict[str, Any]]:
    response = service.client.get(f"/v1/evaluations/{job_id}/samples")
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines()]


def per_document(found: list[dict[str, Any]], metric: str) -> dict[int, bool]:
    return {r["doc_id"]: r["metrics"][metric] == 1 for r in found if r["task"] == TASK}


def discordant(first: dict[int, bool], second: dict[int, bool]) -> tuple[int, int]:
    assert set(first) == set(second) == set(range(len(ROWS)))
    return (
        sum(first[d] and not second[d] for d in first),
        sum(second[d] and not first[d] for d in first),
    )


def comparison_rows(service: Service, merge_id: str) -> dict[str, dict[str, Any]]:
    view = service.client.get(f"/v1/merges/{merge_id}").json()
    rows = {r["metric"]: r for r in view["result"]["evaluation"]["comparison"]}
    assert set(rows) == {"acc", "acc_norm", "brier_score"}
    return {metric: {i["role"]: i for i in row["inputs"]} for metric, row in rows.items()}


def evaluated(service: Service, merge: dict[str, Any]) -> dict[str, str]:
    """The merge's evaluation and both experts', by role: job ids."""
    jobs = {"merge": merge["result"]["evaluation"]["job_id"]}
    for role, expert in (("task", "math"), ("language", "swh")):
        response = service.client.post(
            "/v1/evaluations", json={"source": expert, "evaluation": EVALUATION}
        )
        assert response.status_code == 202, response.text
        jobs[role] = response.json()["id"]
    for job_id in jobs.values():
        job = service.wait(job_id, kind="evaluations")
        assert job["status"] == "succeeded", job["error"]
    return jobs


def test_each_score_is_paired_on_its_own_metric(tmp_path: Path, examples: Path) -> None:
    questions = [{"question": f"Swali: {n} ni nini?\nJibu:", "choices": CHOICES, "label": label}
                 for n, label in ROWS]  # fmt: skip
    metrics = {"acc": "mean", "acc_norm": "mean", "brier_score": "brier_score"}
    write_choice_yaml(tmp_path / "tasks", TASK, questions, metrics)
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples, eval_tasks_dir=tmp_path / "tasks"
    ) as service:
        merge = service.wait(service.submit({**layer_swap(), "evaluation": EVALUATION})["id"])
        assert merge["status"] == "succeeded", merge["error"]
        jobs = evaluated(service, merge)
        found = {role: records(service, job_id) for role, job_id in jobs.items()}
        for record in found["merge"]:  # `correct` stays, for clients that read it: acc's
            assert record["correct"] is (record["metrics"]["acc"] == 1)
        rows = comparison_rows(service, merge["id"])
        counts = {}
        for metric in ("acc", "acc_norm"):
            for role in ("task", "language"):
                expected = discordant(
                    per_document(found["merge"], metric), per_document(found[role], metric)
                )
                test = rows[metric][role]["paired_test"]
                assert test is not None, rows[metric][role]
                assert (test["only_first"], test["only_second"]) == expected, (metric, role)
                assert test["documents"] == len(ROWS)
                assert test["p_value"] == mcnemar_exact(*expected)
                counts[metric, role] = expected
        # What the questions were chosen for: read by acc, acc_norm's test would say (0, 0).
        assert counts["acc", "language"] == (0, 0)
        assert counts["acc_norm", "language"] == (5, 4)
        for role in ("task", "language"):  # a value per document that is not right/wrong
            entry = rows["brier_score"][role]
            assert entry["paired_test"] is None
            assert entry["verdict"] == (
                "no paired test: the per-sample records say no right/wrong by brier_score"
            )

        # Records kept without per-document metrics (`correct` only) still load, and give no
        # paired test: which metric `correct` stood for, they do not say.
        path = service.settings.evaluations_dir / "default" / jobs["language"] / "samples.jsonl"
        legacy = [{k: v for k, v in r.items() if k != "metrics"} for r in found["language"]]
        path.write_text("".join(json.dumps(r) + "\n" for r in legacy), encoding="utf-8")
        assert records(service, jobs["language"]) == legacy
        rows = comparison_rows(service, merge["id"])
        for metric in ("acc", "acc_norm"):
            assert rows[metric]["language"]["paired_test"] is None
            assert rows[metric]["language"]["verdict"].startswith("no paired test")
            assert rows[metric]["task"]["paired_test"] is not None
