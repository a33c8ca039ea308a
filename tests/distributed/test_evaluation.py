"""Evaluations on the Celery `eval` queue with real `layerswap worker` processes: a generation
and a multiple-choice task scored as the reference computes them, and a worker SIGKILLed in
the middle of an evaluation whose second attempt answers the finished requests from the
first attempt's request cache."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest

from tests.distributed.conftest import Cluster, wait_for
from tests.evaluation.conftest import (
    CHOICE_QUESTIONS,
    CHOICE_TASK,
    MAX_GEN_TOKS,
    TASK,
    ChoiceTask,
    Model,
    reference_picks,
    with_data,
    write_choice_task,
)
from tests.evaluation.conftest import CHOICES as CHOICE_LIST

DOCUMENTS = 48  # enough generation requests that a kill lands between two batches


@pytest.fixture(scope="module")
def eval_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Model, ChoiceTask]:
    import torch

    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("eval-worker")
    path = make_checkpoint(root / "model", dtype=torch.float32, seed=11, layers=2)
    model = with_data(path, root / "eval-data", count=DOCUMENTS)
    tasks = root / "tasks"
    picks = reference_picks(path, CHOICE_QUESTIONS, CHOICE_LIST)
    return model, ChoiceTask(tasks, picks, write_choice_task(tasks, picks))


@pytest.fixture
def cluster_settings(eval_model: tuple[Model, ChoiceTask]) -> dict[str, Any]:
    model, choice = eval_model
    return {
        "eval_data_dir": model.data_dir,
        "eval_tasks_dir": choice.tasks_dir,
        "extra_roots": [model.path.parent],
    }


def submit(cluster: Cluster, model: Model, tasks: list[str]) -> dict[str, Any]:
    evaluation = {"tasks": tasks, "num_fewshot": 0, "batch_size": 1,
                  "max_gen_toks": MAX_GEN_TOKS, "dtype": "float32"}  # fmt: skip
    response = cluster.service.client.post(
        "/v1/evaluations", json={"source": str(model.path), "evaluation": evaluation}
    )
    assert response.status_code == 202, response.text
    return dict(response.json())


def finished(job: dict[str, Any]) -> bool:
    return job["status"] in ("succeeded", "failed", "canceled")


def score(job: dict[str, Any], task: str, metric: str) -> float:
    (value,) = [
        s["value"]
        for s in job["result"]["scores"]
        if s["task"] == task
        and s["metric"] == metric
        and s["filter"] in ("none", "remove_whitespace")
    ]
    return float(value)


def test_an_evaluation_runs_on_the_eval_queue(
    cluster: Cluster, eval_model: tuple[Model, ChoiceTask], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API as its image has it, without lm-eval (None in sys.modules: not importable):
    it checks task names all the same, and the worker, which has lm-eval, evaluates."""
    model, choice = eval_model
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    unknown = cluster.service.client.post(
        "/v1/evaluations",
        json={"source": str(model.path), "evaluation": {"tasks": ["no_such_task_xx"]}},
    )
    assert unknown.status_code == 422, unknown.text
    assert unknown.json()["error"]["details"]["field"] == "evaluation.tasks.0"
    job = submit(cluster, model, [CHOICE_TASK, TASK])
    raw = wait_for(lambda: cluster.redis.client().lrange("eval", 0, -1), "the message in Redis")
    assert len(raw) == 1 and json.loads(raw[0])["headers"]["task"] == "layerswap.run_job"
    assert cluster.redis.client().llen("merge") == 0

    worker = cluster.start_worker()
    done = cluster.wait_until(job["id"], finished, kind="evaluations")
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 1
    assert score(done, CHOICE_TASK, "acc") == pytest.approx(sum(choice.right) / len(choice.right))
    assert score(done, TASK, "exact_match") == pytest.approx(sum(model.right) / DOCUMENTS)
    assert done["result"]["requests_run"] == {
        "loglikelihood": len(CHOICE_LIST) * len(CHOICE_QUESTIONS),
        "generate_until": DOCUMENTS,
    }
    assert f"job {job['id']}: attempt 1 started" in worker.text()


def test_a_sigkilled_evaluation_resumes_from_its_request_cache(
    cluster: Cluster, eval_model: tuple[Model, ChoiceTask]
) -> None:
    model, _ = eval_model
    worker = cluster.start_worker()
    job = submit(cluster, model, [TASK])

    def between_batches(seen: dict[str, Any]) -> bool:
        progress = seen.get("progress") or {}
        return seen["stage"] == "evaluating" and 4 <= progress.get("done", 0) < DOCUMENTS - 8

    seen = cluster.wait_until(job["id"], between_batches, kind="evaluations")
    worker.kill()
    assert cluster.job(job["id"], "evaluations")["status"] == "running"  # nobody finished it
    cluster.start_worker()
    done = cluster.wait_until(job["id"], finished, kind="evaluations")
    assert done["status"] == "succeeded", done["error"]
    assert done["attempts"] == 2
    # What the first attempt reported done was answered from its cache, not asked again.
    assert done["result"]["requests_run"]["generate_until"] <= DOCUMENTS - seen["progress"]["done"]
    assert score(done, TASK, "exact_match") == pytest.approx(sum(model.right) / DOCUMENTS)
    samples = cluster.service.client.get(f"/v1/evaluations/{job['id']}/samples")
    assert samples.status_code == 200
    records = [json.loads(line) for line in samples.text.splitlines()]
    correct = {r["doc_id"]: r["correct"] for r in records if r["filter"] == "remove_whitespace"}
    assert correct == dict(enumerate(model.right))


def test_a_sweep_runs_on_workers(cluster: Cluster, eval_model: tuple[Model, ChoiceTask]) -> None:
    """One pair × 2 configurations + a soup, merged on the merge queue and evaluated on the eval
    queue by a real worker; the leaderboard is what the evaluation jobs report."""
    worker = cluster.start_worker()
    evaluation = {"tasks": [TASK], "num_fewshot": 0, "batch_size": 4, "limit": 8,
                  "max_gen_toks": MAX_GEN_TOKS, "dtype": "float32"}  # fmt: skip
    body = {
        "task_experts": ["math"], "language_experts": ["swh"], "base": "base",
        "configurations": [{"bottom": 1, "top": 1}, {"bottom": 2, "top": 2}],
        "baselines": [{"method": "soup"}], "evaluation": evaluation,
        "objective": {"task": TASK, "metric": "exact_match", "filter": "remove_whitespace"},
        "keep": "all",
    }  # fmt: skip
    response = cluster.service.client.post("/v1/sweeps", json=body)
    assert response.status_code == 202, response.text
    sweep_id = response.json()["id"]

    def ended() -> dict[str, Any] | None:
        sweep = dict(cluster.service.client.get(f"/v1/sweeps/{sweep_id}").json())
        return sweep if sweep["status"] in ("succeeded", "failed", "canceled") else None

    done = wait_for(ended, "the sweep", timeout=300)
    assert done["status"] == "succeeded", done["result"]
    assert done["progress"]["by_status"] == {"succeeded": 6}
    board = cluster.service.client.get(f"/v1/sweeps/{sweep_id}/leaderboard").json()
    reported = {}
    for trial in done["trials"]:
        job = cluster.job(trial["evaluation_job_id"], "evaluations")
        reported[trial["config"]] = score(job, TASK, "exact_match")
        assert f"job {trial['merge_job_id']}: attempt 1 started" in worker.text()
        assert f"job {trial['evaluation_job_id']}: attempt 1 started" in worker.text()
    assert {r["config"]: r["mean"] for r in board["rows"]} == reported
