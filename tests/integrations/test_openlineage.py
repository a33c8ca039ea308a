"""OpenLineage through the real openlineage-python client, to a real HTTP receiver that records
what the client sends: START and COMPLETE / FAIL per job, inputs versioned by Hub commit sha or
content digest, the output's sha256s, the request as a job facet; a backend that is down never
fails a merge."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import Service, layer_swap, running_service
from tests.service.test_hub_api import upload
from tests.webhooks.receiver import Receiver

TOKEN = "hf_lineage_token_0123456789abcdef"


@pytest.fixture
def backend() -> Iterator[Receiver]:
    running = Receiver().start()
    yield running
    running.stop()


@pytest.fixture
def service(tmp_path: Path, examples: Path, backend: Receiver, hub: Any) -> Iterator[Service]:
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    with running_service(
        tmp_path, f"sqlite:///{tmp_path / 'db.sqlite'}", examples,
        openlineage_url=f"http://127.0.0.1:{backend.port}",
        hub_credentials={"default": {"team-a": TOKEN}},
    ) as running:  # fmt: skip
        yield running


def events_of(backend: Receiver, job_id: str, count: int) -> list[dict[str, Any]]:
    run_id = str(uuid.UUID(job_id))

    def found() -> list[dict[str, Any]]:
        sent = [json.loads(r.body) for r in list(backend.received)]
        mine = [e for e in sent if e["run"]["runId"] == run_id]
        return mine if len(mine) >= count else []

    return list(backend.wait_for(found, f"{count} lineage events of {job_id}"))


def test_a_merge_is_a_run_with_versioned_inputs_and_its_output(
    service: Service, backend: Receiver
) -> None:
    job = service.wait(service.submit(layer_swap())["id"])
    assert job["status"] == "succeeded"
    start, complete = events_of(backend, job["id"], 2)
    assert all(r.path == "/api/v1/lineage" for r in backend.received)
    assert (start["eventType"], complete["eventType"]) == ("START", "COMPLETE")
    assert complete["job"]["namespace"] == "layerswap"
    assert complete["job"]["name"] == f"default.merge.{job['output']['name']}"
    facets = complete["job"]["facets"]
    assert facets["jobType"]["jobType"] == "MERGE"
    assert facets["layerswap_request"]["request"]["params"] == job["request"]["params"]

    lineage = service.client.get(
        f"/v1/artifacts/{job['output']['artifact_id']}/lineage", params={"direction": "ancestors"}
    ).json()
    digests = {a["location"]: a["content_digest"] for a in lineage["artifacts"]}
    inputs = {(d["namespace"], d["name"]): d for d in complete["inputs"]}
    assert {name for _, name in inputs} == {
        str(service.checkpoints / "math"), str(service.checkpoints / "swh")
    }  # fmt: skip
    for (_, name), dataset in inputs.items():
        assert dataset["facets"]["version"]["datasetVersion"] == digests[name]
    (output,) = complete["outputs"]
    assert (output["namespace"], output["name"]) == ("file", job["output"]["location"])
    files = {f["name"]: f["sha256"] for f in job["output"]["files"]}
    assert output["facets"]["layerswap_files"]["files"] == files
    assert output["facets"]["version"]["datasetVersion"] == digests[job["output"]["location"]]
    assert {d["name"] for d in start["inputs"]} == {"math", "swh"}  # as asked, before lineage


def test_hub_inputs_carry_their_commits_and_a_failure_is_a_fail_event(
    service: Service, backend: Receiver, hub: Any, examples: Path
) -> None:
    shas = {n: upload(hub, f"team-a/{n}", examples / n, private=True) for n in ("math", "swh")}
    body = {
        "method": "layer_swap", "credential": "team-a", "params": {"bottom": 1, "top": 1},
        "experts": {"task": ["hf://team-a/math"], "language": ["hf://team-a/swh"]},
        "output": {"name": "from-hub"},
    }  # fmt: skip
    job = service.wait(service.submit(body)["id"])
    assert job["status"] == "succeeded", job["error"]
    _, complete = events_of(backend, job["id"], 2)
    versions = {
        d["name"]: d["facets"]["version"]["datasetVersion"]
        for d in complete["inputs"] if d["namespace"] == "huggingface"
    }  # fmt: skip
    assert versions == {"team-a/math": shas["math"], "team-a/swh": shas["swh"]}

    # Publishing where the token cannot write fails the merge: FAIL, with the error.
    body["output"] = {"name": "denied", "hub": {"repo": "team-b/nope", "credential": "team-a"}}
    failed = service.wait(service.submit(body)["id"])
    assert failed["status"] == "failed"
    _, fail = events_of(backend, failed["id"], 2)
    assert fail["eventType"] == "FAIL"
    assert failed["error"]["code"] in fail["run"]["facets"]["errorMessage"]["message"]
    assert fail["outputs"] == []


def test_a_lineage_backend_that_is_down_fails_no_merge(service: Service, backend: Receiver) -> None:
    backend.stop()
    job = service.wait(service.submit(layer_swap())["id"])
    assert job["status"] == "succeeded"
    assert backend.received == []
