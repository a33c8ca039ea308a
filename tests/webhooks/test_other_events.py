"""Events beyond merges: a sweep's evaluations and its end, and a merge's output published to
the Hub (artifact.published, also to the merge's one-off URL)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.evaluation.conftest import Model
from tests.service.conftest import Service, running_service
from tests.sweeps.test_api import CONFIGS, sweep_body, wait
from tests.webhooks.conftest import FAST, subscribe
from tests.webhooks.receiver import Receiver

TOKEN = "hf_webhook_events_token_0123456789"


@pytest.fixture
def service(tmp_path: Path, examples: Path, math_expert: Model, hub: Any) -> Iterator[Service]:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        eval_data_dir=math_expert.data_dir, reconcile_interval_s=0.2,
        hub_credentials={"default": {"team-a": TOKEN}}, **FAST,
    ) as running:  # fmt: skip
        yield running


def test_sweep_evaluation_and_publish_events(
    service: Service, receiver: Receiver, hub: Any
) -> None:
    subscribe(service, receiver, events=["sweep.completed", "evaluation.completed"])
    body = sweep_body(task_experts=["math"], language_experts=["swh"], baselines=[],
                      configurations=CONFIGS[:2], keep="none")  # fmt: skip
    done = wait(service, service.client.post("/v1/sweeps", json=body).json()["id"])
    assert done["status"] == "succeeded", done["result"]
    (ended,) = receiver.wait_for(lambda: receiver.of_type("sweep.completed"), "sweep.completed")
    assert ended.verified is not None
    assert ended.verified["data"]["id"] == done["id"]
    assert ended.verified["data"]["status"] == "succeeded"
    assert ended.verified["data"]["links"]["leaderboard"].endswith(
        f"/v1/sweeps/{done['id']}/leaderboard"
    )
    evaluations = {t["evaluation_job_id"] for t in done["trials"]}
    received = receiver.wait_for(
        lambda: (
            len(receiver.of_type("evaluation.completed")) == len(evaluations)
            and receiver.of_type("evaluation.completed")
        ),
        "every evaluation.completed",
    )
    assert {json.loads(r.body)["data"]["id"] for r in received} == evaluations
    assert {json.loads(r.body)["data"]["sweep_id"] for r in received} == {done["id"]}
    assert not receiver.of_type("merge.succeeded")  # not subscribed

    # A merge published to the Hub: artifact.published with the commit, to the one-off URL.
    receiver.secrets.append(service.client.get("/v1/webhooks/secret").json()["secret"])
    merge = {
        "method": "layer_swap", "experts": {"task": ["math"], "language": ["swh"]},
        "params": {"bottom": 1, "top": 1}, "webhook": receiver.url + "/once",
        "output": {"name": "published", "hub": {"repo": "team-a/swapped", "credential": "team-a"}},
    }  # fmt: skip
    job = service.wait(service.submit(merge)["id"])
    assert job["status"] == "succeeded", job["error"]
    (published,) = receiver.wait_for(
        lambda: receiver.of_type("artifact.published"), "artifact.published"
    )
    assert published.path == "/hooks/once" and published.verified is not None
    data = published.verified["data"]
    assert (data["repo"], data["job_id"]) == ("team-a/swapped", job["id"])
    assert data["commit"] == hub.head("team-a/swapped") == job["result"]["published"]["commit"]
    assert data["id"] == job["output"]["artifact_id"]
    receiver.wait_for(
        lambda: [r for r in receiver.of_type("merge.succeeded") if r.path == "/hooks/once"],
        "the merge's own end",
    )
