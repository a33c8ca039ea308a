"""A sweep of Hub experts: pinned at submit, layer swaps assembled in memory from the fetched
shards, the best written from the Hub by the ordinary engine and scoring what it scored in
memory; unknown repos refused."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation.conftest import TASK, Model
from tests.evaluation.test_api import EVALUATION
from tests.service.conftest import Service, running_service
from tests.service.test_hub_api import upload
from tests.sweeps.test_api import OBJECTIVE, objective_of, submit, wait

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
