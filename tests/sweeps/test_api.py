"""Sweeps through the API on the local executor with the real merge and evaluation pipeline:
2 × 2 expert pairs × 3 layer-swap configurations + a soup baseline + the experts; the
leaderboard's aggregates recomputed here from each job's own result; CSV, Markdown and PNG;
keep policies on disk; cancel; searches within their budget; bad specs refused."""

from __future__ import annotations

import csv
import io
import json
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation.conftest import TASK, Model
from tests.evaluation.test_api import EVALUATION
from tests.helpers import wait_for
from tests.service.conftest import Service, running_service
from tests.sweeps.test_expand import BOMB, fitting_by_hand
from worker.examples import MATH_SCALE, SWH_SCALE, make_checkpoint

OBJECTIVE = {"task": TASK, "metric": "exact_match", "filter": "remove_whitespace"}
CONFIGS = [{"bottom": 1, "top": 1}, {"bottom": 2, "top": 1},
           {"bottom": 1, "top": 1, "bottom_transition": 1, "top_transition": 1}]  # fmt: skip
LABELS = ["b=1 u=1", "b=2 u=1", "b=1 u=1 t=1/1"]


@pytest.fixture
def service(tmp_path: Path, examples: Path, math_expert: Model) -> Iterator[Service]:
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        eval_data_dir=math_expert.data_dir, reconcile_interval_s=0.2,
    ) as running:  # fmt: skip
        base = running.checkpoints / "base"
        make_checkpoint(running.checkpoints / "math2", base=base, seed=11, layer_scale=MATH_SCALE,
                        non_layer_scale=0.01)  # fmt: skip
        make_checkpoint(running.checkpoints / "swh2", base=base, seed=12, layer_scale=SWH_SCALE,
                        non_layer_scale=0.03)  # fmt: skip
        yield running


def sweep_body(**changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "task_experts": ["math", "math2"],
        "language_experts": ["swh", "swh2"],
        "base": "base",
        "configurations": CONFIGS,
        "baselines": [{"method": "soup"}, {"method": "experts"}],
        "evaluation": EVALUATION,
        "objective": OBJECTIVE,
    }
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


def submit(service: Service, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    response = service.client.post("/v1/sweeps", json=body, headers=headers)
    assert response.status_code == 202, response.text
    return dict(response.json())


def wait(service: Service, sweep_id: str, timeout: float = 600) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def ended() -> dict[str, Any] | None:
        seen[:] = [dict(service.client.get(f"/v1/sweeps/{sweep_id}").json())]
        return seen[0] if seen[0]["status"] in ("succeeded", "failed", "canceled") else None

    def progress() -> str:
        return f"sweep {sweep_id} to end (progress {seen[0]['progress']})"

    return wait_for(ended, progress, timeout, interval=0.2)


def objective_of(service: Service, evaluation_id: str) -> float:
    """The objective as the evaluation job itself reports it."""
    job = service.client.get(f"/v1/evaluations/{evaluation_id}").json()
    (value,) = [
        s["value"]
        for s in job["result"]["scores"]
        if (s["task"], s["metric"], s["filter"]) == (TASK, "exact_match", "remove_whitespace")
    ]
    return float(value)


def test_a_sweep_merges_evaluates_and_ranks(service: Service) -> None:
    created = submit(service, sweep_body(), **{"Idempotency-Key": "sweep-1"})
    again = submit(service, sweep_body(), **{"Idempotency-Key": "sweep-1"})
    assert again["id"] == created["id"]
    # 4 pairs × 3 layer-swap configurations evaluated in memory, 4 soup merges, 4 experts'
    # evaluations; each merge's evaluation is created when the merge succeeds.
    assert created["progress"]["jobs"] == 4 * 3 + 4 + 4
    done = wait(service, created["id"])
    assert done["status"] == "succeeded", done["result"]
    best_is_a_swap = done["result"]["best"]["config"] != "soup"
    written = 4 if best_is_a_swap else 0  # the best configuration, written at the end
    assert done["progress"]["jobs"] == 4 * 3 + 4 * 2 + 4 + written
    assert done["progress"]["by_status"] == {"succeeded": 24 + written}
    assert len(done["result"].get("written", [])) == written

    # Recompute the leaderboard from the jobs' own results.
    by_config: dict[str, dict[int, float]] = {}
    experts: dict[str, float] = {}
    for trial in done["trials"]:
        if trial["kept"]:
            assert trial["evaluation_job_id"] is None and trial["merge_status"] == "succeeded"
            continue
        assert trial["in_memory"] == (trial["config"] in LABELS)
        assert (trial["artifact_id"] is None) == (trial["config"] != "soup")
        value = objective_of(service, trial["evaluation_job_id"])
        assert trial["score"] == value
        if trial["pair"] is None:
            experts[trial["config"].removeprefix("expert:")] = value
        else:
            by_config.setdefault(trial["config"], {})[trial["pair"]] = value
    assert set(by_config) == {*LABELS, "soup"} and set(experts) == {"math", "math2", "swh", "swh2"}
    board = service.client.get(f"/v1/sweeps/{created['id']}/leaderboard").json()
    assert [r["rank"] for r in board["rows"]] == [1, 2, 3, 4]
    means = [r["mean"] for r in board["rows"]]
    assert means == sorted(means, reverse=True)
    for row in board["rows"]:
        values = list(by_config[row["config"]].values())
        assert row["mean"] == pytest.approx(sum(values) / 4)
        assert (row["min"], row["max"]) == (min(values), max(values))
        assert row["pairs_scored"] == 4
        assert row["ci95"][0] <= row["mean"] <= row["ci95"][1]
        assert (row["vs_best"] is None) == (row["rank"] == 1)
        if row["vs_best"] is not None:
            assert row["vs_best"]["documents"] == 4 * 8  # 4 pairs × 8 documents, paired
    assert board["experts"] == experts
    for entry in board["per_pair"]:
        assert entry["task_expert_score"] == experts[entry["task_expert"]]
        assert entry["language_expert_score"] == experts[entry["language_expert"]]
        best_expert = max(experts[entry["task_expert"]], experts[entry["language_expert"]])
        for config, cell in entry["configs"].items():
            assert cell["value"] == by_config[config][entry["pair"]]
            assert cell["minus_best_expert"] == pytest.approx(cell["value"] - best_expert)

    # CSV and Markdown say the same as the JSON.
    text = service.client.get(f"/v1/sweeps/{created['id']}/leaderboard?format=csv").text
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [(r["config"], float(r["mean"])) for r in rows] == [
        (r["config"], r["mean"]) for r in board["rows"]
    ]
    markdown = service.client.get(f"/v1/sweeps/{created['id']}/leaderboard?format=markdown").text
    for row in board["rows"]:
        assert f"| {row['rank']} | {row['config']} | {row['mean']:.4f} |" in markdown
    png = service.client.get(f"/v1/sweeps/{created['id']}/leaderboard.png")
    assert png.headers["content-type"] == "image/png"
    import matplotlib.image

    pixels = matplotlib.image.imread(io.BytesIO(png.content), format="png")
    assert pixels.shape[0] >= 300 and pixels.shape[1] >= 500
    assert pixels.std() > 0.05  # not a blank canvas

    # keep: best — only the best configuration's merged models are on disk: the soups if the
    # soup won, else the best layer swap written at the end (no other swap was ever written).
    best = board["rows"][0]["config"]
    assert done["result"]["best"] == {"config": best, "mean": board["rows"][0]["mean"]}
    for trial in done["trials"]:
        if trial["artifact_id"] is None:
            continue
        artifact = service.client.get(f"/v1/artifacts/{trial['artifact_id']}").json()
        kept = trial["config"] == best
        assert (artifact["deleted_at"] is None) == kept, trial
        assert Path(artifact["location"]).is_dir() == kept
        assert bool(artifact["scores"]) != trial["kept"]  # scores stay with deleted artifacts
    on_disk = sorted((service.settings.artifacts_dir / "default").glob("sweep-*"))
    assert len(on_disk) == 4


@pytest.mark.parametrize("keep", ["none", "all"])
def test_keep_policies_leave_what_they_promise(service: Service, keep: str) -> None:
    body = sweep_body(task_experts=["math"], language_experts=["swh"], baselines=[],
                      configurations=CONFIGS[:2], keep=keep,
                      objective={"task": TASK, "metric": "exact_match"})  # fmt: skip
    done = wait(service, submit(service, body)["id"])
    assert done["status"] == "succeeded", done["result"]
    board = service.client.get(f"/v1/sweeps/{done['id']}/leaderboard").json()
    assert board["objective"]["filter"] == "flexible-extract"  # the default's first choice
    outputs = sorted((service.settings.artifacts_dir / "default").glob("sweep-*"))
    merges = [t for t in done["trials"] if t["merge_job_id"]]
    assert len(merges) == (2 if keep == "all" else 0)  # keep none: evaluated in memory
    assert len(outputs) == (2 if keep == "all" else 0)
    assert all(t["score"] is not None for t in done["trials"])


def test_random_and_model_based_searches_respect_their_budget(service: Service) -> None:
    grid = {"bottom": [0, 1, 2], "top": [1, 2]}  # 6 configurations
    for search, expected in (({"strategy": "random", "trials": 2, "seed": 3}, 2),
                             ({"strategy": "optuna", "trials": 3, "parallel": 1}, 3)):  # fmt: skip
        body = sweep_body(task_experts=["math"], language_experts=["swh"], baselines=[],
                          configurations=None, grid=grid, search=search, keep="none")  # fmt: skip
        done = wait(service, submit(service, body)["id"])
        assert done["status"] == "succeeded", done["result"]
        configs = {t["config"] for t in done["trials"]}
        assert len(configs) == expected, (search, configs)
        assert all(t["score"] is not None for t in done["trials"]), json.dumps(done["trials"])


def test_cancel_stops_every_job_of_the_sweep(service: Service) -> None:
    created = submit(service, sweep_body(keep="all"))
    response = service.client.post(f"/v1/sweeps/{created['id']}/cancel")
    assert response.status_code == 202, response.text
    done = wait(service, created["id"])
    assert done["status"] == "canceled"
    statuses = done["progress"]["by_status"]
    assert set(statuses) <= {"canceled", "succeeded", "failed"} and statuses.get("canceled", 0) > 0
    again = service.client.post(f"/v1/sweeps/{created['id']}/cancel")
    assert again.status_code == 409


def test_bad_sweeps_are_refused_with_nothing_queued(service: Service) -> None:
    make_checkpoint(service.checkpoints / "qwen", arch="qwen2", layers=6)
    cases = [
        (
            sweep_body(
                grid={"bottom": list(range(6)), "top": list(range(6))},
                configurations=None,
                budget=50,
            ),
            "budget",
        ),
        (sweep_body(grid={"bottom": [1]}, configurations=None), "grid.top"),
        (sweep_body(objective={**OBJECTIVE, "task": "other"}), "objective"),
        (sweep_body(grid={"bottom": [1], "top": [1]}), "configurations"),
        (sweep_body(task_experts=["nope"]), "task_experts.0"),
        (sweep_body(configurations=[{"bottom": 4, "top": 3}]), "configurations.0"),
        (sweep_body(language_experts=["qwen"]), "pairs.0"),
        (sweep_body(baselines=[{"method": "ties", "params": {"density": 2}}]), "baselines"),
        (
            sweep_body(evaluation={**EVALUATION, "tasks": [TASK, "mgsm_nope_xx"]}),
            "evaluation.tasks.1",
        ),
        (sweep_body(search={"strategy": "random"}), "search"),
    ]
    for body, field in cases:
        response = service.client.post("/v1/sweeps", json=body)
        assert response.status_code == 422, (field, response.text)
        assert field in response.text, (field, response.text)
    budget = service.client.post("/v1/sweeps", json=cases[0][0]).json()["error"]
    # The (b, u) of the grid that fit 6 layers × 4 pairs (evaluated in memory: one job each),
    # the soup on 4 pairs × (merge + evaluation), the 4 experts, and the best configuration
    # written for the 4 pairs at the end.
    fitting = sum(1 for b in range(6) for u in range(6) if b + u <= 6)
    assert budget["details"]["jobs"] == fitting * 4 + 4 * 2 + 4 + 4
    assert "expands to" in budget["message"]
    assert service.client.get("/v1/sweeps").json()["items"] == []
    assert service.client.get("/v1/merges").json()["items"] == []


def test_a_configuration_merged_before_is_reused_not_merged_again(service: Service) -> None:
    body = sweep_body(task_experts=["math"], language_experts=["swh"], baselines=[], keep="all",
                      configurations=CONFIGS[:2])  # fmt: skip
    first = wait(service, submit(service, body)["id"])
    assert first["status"] == "succeeded", first["result"]
    made = {t["config"]: t for t in first["trials"]}

    again = wait(service, submit(service, {**body, "configurations": CONFIGS[1:]})["id"])
    assert again["status"] == "succeeded", again["result"]
    trials = {t["config"]: t for t in again["trials"]}
    reused = service.client.get(f"/v1/merges/{trials[LABELS[1]]['merge_job_id']}").json()
    assert reused["result"]["reused_from"] == made[LABELS[1]]["merge_job_id"]
    assert trials[LABELS[1]]["artifact_id"] == made[LABELS[1]]["artifact_id"]
    evaluation = service.client.get(f"/v1/evaluations/{trials[LABELS[1]]['evaluation_job_id']}")
    assert evaluation.json()["result"]["ran"] == []  # its scores were reused as well
    assert trials[LABELS[1]]["score"] == made[LABELS[1]]["score"]
    fresh = service.client.get(f"/v1/merges/{trials[LABELS[2]]['merge_job_id']}").json()
    assert "reused_from" not in fresh["result"]

    # The language expert's bytes change: the same recipe is merged again.
    make_checkpoint(service.checkpoints / "swh", base=service.checkpoints / "base", seed=99,
                    layer_scale=SWH_SCALE, non_layer_scale=0.03)  # fmt: skip
    third = wait(service, submit(service, {**body, "configurations": CONFIGS[1:2]})["id"])
    (trial,) = [t for t in third["trials"] if t["merge_job_id"]]
    merged = service.client.get(f"/v1/merges/{trial['merge_job_id']}").json()
    assert "reused_from" not in merged["result"]
    assert trial["artifact_id"] != made[LABELS[1]]["artifact_id"]


def test_a_grid_of_millions_is_refused_before_it_is_built(service: Service) -> None:
    """6,291,456 combinations in a request of about 1 KB: counted, not built (building them
    took minutes and gigabytes), and refused naming the count and the budget."""
    one_pair = {"task_experts": ["math"], "language_experts": ["swh"], "baselines": [],
                "configurations": None}  # fmt: skip
    # The source and depth checks on the way are paid once, unmeasured.
    small = sweep_body(**one_pair, grid={"bottom": list(range(6)), "top": [0, 1]}, budget=5)
    assert service.client.post("/v1/sweeps", json=small).status_code == 422
    body = sweep_body(**one_pair, grid=BOMB)
    assert len(json.dumps(body)) < 1100
    tracemalloc.start()
    try:
        response = service.client.post("/v1/sweeps", json=body)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert response.status_code == 422, response.text
    error = response.json()["error"]
    fit = fitting_by_hand(6)  # the example models have 6 layers
    assert error["details"] == {"field": "budget", "jobs": fit + 1, "budget": 200,
                                "combinations": 6_291_456, "configurations": fit}  # fmt: skip
    assert "more than its budget of 200" in error["message"]
    assert f"{fit} of the grid's 6291456 combinations fit the model's 6 layers" in error["message"]
    assert peak < 50_000_000, peak  # bytes, in every thread of this process
    assert service.client.get("/v1/sweeps").json()["items"] == []


def test_request_sizes_are_bounded_naming_the_field_and_the_limit(service: Service) -> None:
    make_checkpoint(service.checkpoints / "deep", layers=32)
    grid = {"bottom": [1], "top": [1]}
    one = {"configurations": None, "grid": grid}
    cases = [
        (sweep_body(**one) | {"grid": {**grid, "bottom": list(range(65))}}, "grid.bottom", "64"),
        (sweep_body(**one) | {"grid": {**grid, "top_transition": list(range(17))}},
         "grid.top_transition", "16"),
        (sweep_body(**one) | {"grid": {**grid, "top": [1025]}}, "grid.top.0", "1024"),
        (sweep_body(task_experts=["m" * 4097]), "task_experts.0", "4096"),
        (sweep_body(task_experts=[f"m{i}" for i in range(17)]), "task_experts", "16"),
        (sweep_body(objective={**OBJECTIVE, "metric": "m" * 101}), "objective.metric", "100"),
        (sweep_body(baselines=[{"method": "soup", "params": {f"p{i}": 1 for i in range(17)}}]),
         "baselines.0.params", "16"),
        (sweep_body(search={"strategy": "random", "trials": 1001}), "search.trials", "1000"),
        (sweep_body(budget=1001), "budget", "1000"),
        # 32 layers: 295,296 of BOMB's combinations fit, too many to choose among at random.
        (sweep_body(task_experts=["deep"], configurations=None, grid=BOMB,
                    search={"strategy": "random", "trials": 5}), "grid", "10000"),
    ]  # fmt: skip
    for body, field, limit in cases:
        response = service.client.post("/v1/sweeps", json=body)
        assert response.status_code == 422, (field, response.text)
        error = response.json()["error"]
        assert error["details"]["field"] == field, error
        assert error["message"].startswith(f"{field}: ") and limit in error["message"], error
    assert service.client.get("/v1/sweeps").json()["items"] == []
