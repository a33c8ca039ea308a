"""Sweeps and the Hub: Hub experts pinned at submit, layer swaps assembled in memory from the
fetched shards, the best written from the Hub by the ordinary engine and scoring what it scored
in memory; unknown repos refused; `publish_best` publishing each pair's best model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.methods.layer_swap import LayerSwapParams
from service.sweeps.expand import label
from tests.evaluation.conftest import TASK, Model
from tests.evaluation.test_api import EVALUATION
from tests.service.conftest import Service, running_service
from tests.service.test_hub_api import upload
from tests.sweeps.test_api import CONFIGS, OBJECTIVE, objective_of, submit, wait
from worker.examples import SWH_SCALE, make_checkpoint

TOKEN = "hf_sweep_secret_token_0123456789"


@pytest.fixture
def service(tmp_path: Path, examples: Path, math_expert: Model, hub: Any) -> Iterator[Service]:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        eval_data_dir=math_expert.data_dir, reconcile_interval_s=0.2,
        hub_credentials={"default": {"team-a": TOKEN}},
    ) as running:  # fmt: skip
        yield running


def test_a_sweep_of_hub_experts(service: Service, examples: Path, hub: Any) -> None:
    shas = {name: upload(hub, f"team-a/{name}", examples / name, private=True)
            for name in ("base", "math", "swh")}  # fmt: skip
    body = {
        "task_experts": ["hf://team-a/math"], "language_experts": ["hf://team-a/swh@main"],
        "base": "hf://team-a/base", "credential": "team-a",
        "configurations": [{"bottom": 1, "top": 1}, {"bottom": 1, "top": 1, "top_transition": 1}],
        "baselines": [{"method": "experts"}], "evaluation": EVALUATION, "objective": OBJECTIVE,
    }  # fmt: skip
    created = submit(service, body)
    assert created["request"]["task_experts"] == [f"hf://team-a/math@{shas['math']}"]
    assert created["request"]["language_experts"] == [f"hf://team-a/swh@{shas['swh']}"]
    hub.commit("team-a/math", {"config.json": b"{}"}, message="break main")  # after submit

    done = wait(service, created["id"])
    assert done["status"] == "succeeded", done["result"]
    experts = {t["config"]: t["score"] for t in done["trials"] if t["pair"] is None}
    assert experts[f"expert:hf://team-a/math@{shas['math']}"] == 0.5  # the data's own answers
    best = done["result"]["best"]["config"]
    (kept,) = [t for t in done["trials"] if t["kept"]]
    assert kept["config"] == best and kept["merge_status"] == "succeeded"
    in_memory = {t["config"]: t["score"] for t in done["trials"] if t["in_memory"]}

    # The written best, evaluated as a file, scores what its assembly scored in memory.
    again = service.client.post(
        "/v1/evaluations", json={"artifact_id": kept["artifact_id"], "evaluation": EVALUATION}
    )
    assert again.status_code == 202, again.text
    evaluated = service.wait(again.json()["id"], kind="evaluations")
    assert evaluated["result"]["ran"] == [TASK]
    assert objective_of(service, evaluated["id"]) == in_memory[best]

    refused = service.client.post(
        "/v1/sweeps", json={**body, "task_experts": ["hf://team-a/nothing-here"]}
    )
    assert refused.status_code == 422, refused.text
    error = refused.json()["error"]
    assert error["code"] == "hub_repo_not_found" and error["details"]["field"] == "task_experts.0"


def test_publish_best_puts_each_pairs_best_model_on_the_hub(
    service: Service, hub: Any, tmp_path: Path
) -> None:
    """In memory: the best configuration is written once per pair and published to that pair's
    repository, holding exactly the local output, a layer swap of the best's parameters."""
    make_checkpoint(service.checkpoints / "swh2", base=service.checkpoints / "base", seed=12,
                    layer_scale=SWH_SCALE, non_layer_scale=0.03)  # fmt: skip
    body = {
        "task_experts": ["math"], "language_experts": ["swh", "swh2"], "base": "base",
        "configurations": CONFIGS[:2], "evaluation": EVALUATION, "objective": OBJECTIVE,
        "publish_best": {"repo": "team-a/swap-{task}-{language}", "credential": "team-a"},
    }  # fmt: skip
    created = submit(service, body)
    done = wait(service, created["id"])
    assert done["status"] == "succeeded", done["result"]
    best = done["result"]["best"]["config"]
    written = sorted(done["result"]["written"], key=lambda w: w["pair"])
    assert [w["published_to"] for w in written] == ["team-a/swap-math-swh", "team-a/swap-math-swh2"]
    for entry in written:
        assert entry["status"] == "succeeded"
        assert entry["published"]["commit"] == hub.head(entry["published_to"])
        artifact = service.client.get(f"/v1/artifacts/{entry['artifact_id']}").json()
        local = {p.name: p.read_bytes() for p in Path(artifact["location"]).iterdir()}
        remote = hub.files(entry["published_to"])
        assert {k: v for k, v in remote.items() if k != ".gitattributes"} == local
        recipe = json.loads(remote["layerswap.json"])["recipe"]
        assert label(LayerSwapParams(**recipe["params"])) == best
        language = body["language_experts"][entry["pair"]]
        assert recipe["experts"]["language"] == [language]
    kept = [t for t in done["trials"] if t["kept"]]
    assert sorted(t["published_to"] for t in kept) == [w["published_to"] for w in written]

    # With keep: all every configuration is written, and publishing reuses the best's output.
    body = {**body, "language_experts": ["swh"], "keep": "all",
            "publish_best": {"repo": "team-a/kept-best", "credential": "team-a"}}  # fmt: skip
    done = wait(service, submit(service, body)["id"])
    assert done["status"] == "succeeded", done["result"]
    (entry,) = done["result"]["written"]
    publishing = service.client.get(f"/v1/merges/{entry['merge_job_id']}").json()
    best = done["result"]["best"]["config"]
    (best_merge,) = [t for t in done["trials"] if t["config"] == best and not t["kept"]]
    assert publishing["result"]["reused_from"] == best_merge["merge_job_id"]
    assert entry["published"]["commit"] == hub.head("team-a/kept-best")


def test_bad_publish_best_is_refused_with_nothing_queued(service: Service, hub: Any) -> None:
    body = {
        "task_experts": ["math"], "language_experts": ["swh", "base"],
        "configurations": CONFIGS[:1], "evaluation": EVALUATION, "objective": OBJECTIVE,
    }  # fmt: skip
    cases = [
        ({"repo": "team-a/one-repo", "credential": "team-a"}, "share a repository"),
        ({"repo": "team-a/x-{model}", "credential": "team-a"}, "only {task} and {language}"),
        ({"repo": "team-a/x-{language}", "credential": "nobody"}, "unknown_credential"),
        ({"repo": "not a repo"}, "publish_best.repo"),
    ]
    for publish, expected in cases:
        response = service.client.post("/v1/sweeps", json={**body, "publish_best": publish})
        assert response.status_code == 422, (publish, response.text)
        assert expected in response.text, (publish, response.text)
    assert service.client.get("/v1/sweeps").json()["items"] == []
    assert service.client.get("/v1/merges").json()["items"] == []


def test_a_failed_publish_fails_the_sweep_and_keeps_its_leaderboard(service: Service) -> None:
    body = {
        "task_experts": ["math"], "language_experts": ["swh"], "base": "base",
        "configurations": CONFIGS[:2], "evaluation": EVALUATION, "objective": OBJECTIVE,
        "publish_best": {"repo": "team-b/not-ours", "credential": "team-a"},  # no write access
    }  # fmt: skip
    done = wait(service, submit(service, body)["id"])
    assert done["status"] == "failed", done["result"]
    (entry,) = done["result"]["written"]
    merge = service.client.get(f"/v1/merges/{entry['merge_job_id']}").json()
    assert merge["status"] == "failed"
    assert merge["error"]["code"] in done["result"]["error"]
    assert entry["merge_job_id"] in done["result"]["error"]
    board = service.client.get(f"/v1/sweeps/{done['id']}/leaderboard").json()
    assert board["rows"][0]["config"] == done["result"]["best"]["config"]
