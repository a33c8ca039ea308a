"""A job's life over HTTP: listing and pagination, cancellation (queued and running), restart
and resume, the event log as JSON and as Server-Sent Events, lineage several generations deep,
analyses, methods, probes and metrics. On SQLite and on PostgreSQL."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from core.db.models import Job
from core.db.session import Database
from tests.helpers import wait_for
from tests.service.conftest import TERMINAL, Service, layer_swap, make_settings, running_service
from worker.executors import LocalExecutor

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class HeldExecutor:
    """Our own Executor that never runs anything: jobs stay queued, as if no worker had come."""

    def __init__(self) -> None:
        self.dispatched: list[str] = []

    def start(self) -> None:
        pass

    def dispatch(self, job_id: str, kind: str) -> None:
        self.dispatched.append(job_id)

    def pending(self) -> set[str]:
        return set(self.dispatched)  # held, never lost: the reconciler leaves them be

    def stop(self) -> None:
        pass


class SourceVanishes(LocalExecutor):
    """The local executor, except that the checkpoint `vanishing/` is deleted as each job is
    handed over: a job naming it passed the checks at submit and fails when it plans."""

    def __init__(self, root: Path, url: str) -> None:
        settings = make_settings(root, url)
        super().__init__(Database(settings.database), settings)
        self.vanishing = settings.source_roots[0] / "vanishing"

    def dispatch(self, job_id: str, kind: str) -> None:
        shutil.rmtree(self.vanishing, ignore_errors=True)
        super().dispatch(job_id, kind)


@pytest.fixture
def vanishing(tmp_path: Path, database_url: str, examples: Path) -> Iterator[Service]:
    """A service whose `vanishing/` source is gone by the time a job submitted with it runs;
    `service.checkpoints / "vanishing"` must be created (a copy of swh/) before that submit."""
    executor = SourceVanishes(tmp_path, database_url)
    with running_service(tmp_path, database_url, examples, job_executor=executor) as running:
        yield running
    executor.db.dispose()


def failing(service: Service) -> dict[str, Any]:
    """A layer swap that is accepted and then fails: its language expert vanishes."""
    shutil.copytree(service.checkpoints / "swh", service.checkpoints / "vanishing")
    return {**layer_swap(), "experts": {"task": ["math"], "language": ["vanishing"]}}


def soup(*models: str, **top: Any) -> dict[str, Any]:
    return {"method": "soup", "models": list(models or ("math", "swh")), **top}


def poll(service: Service, job_id: str, until: Any, *, timeout: float = 60.0) -> dict[str, Any]:
    """GET the job until `until(job)` holds; fail at the deadline, or when the job ends first."""
    seen: list[dict[str, Any]] = []

    def met() -> dict[str, Any] | None:
        seen[:] = [dict(service.client.get(f"/v1/merges/{job_id}").json())]
        job = seen[0]
        if until(job):
            return job
        assert job["status"] not in TERMINAL, f"job {job_id} ended {job['status']}: {job}"
        return None

    def still() -> str:
        return f"job {job_id} (still {seen[0]['status']})"

    return wait_for(met, still, timeout, interval=0.01)


def events_of(service: Service, job_id: str, **params: Any) -> list[dict[str, Any]]:
    response = service.client.get(f"/v1/merges/{job_id}/events", params=params)
    assert response.status_code == 200, response.text
    return list(response.json())


def artifact_entries(service: Service) -> list[str]:
    """Everything under the artifacts directory, hidden staging directories included."""
    root = service.settings.artifacts_dir
    if not root.exists():
        return []
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def output_dir(service: Service, job: dict[str, Any]) -> Path:
    name = job["request"]["output"]["name"] or f"merge-{job['id'][:12]}"
    return service.settings.artifacts_dir / "default" / name


# --- listing ------------------------------------------------------------------------------


def test_list_is_newest_first_with_status_filter_and_cursor_pages(vanishing: Service) -> None:
    service = vanishing
    bodies = [layer_swap(), soup(), layer_swap(top=2), None, soup("swh", "math")]
    ids = [service.submit(body or failing(service))["id"] for body in bodies]
    finished = {job_id: service.wait(job_id)["status"] for job_id in ids}
    assert finished[ids[3]] == "failed"  # its source vanished
    assert [s for i, s in finished.items() if i != ids[3]] == ["succeeded"] * 4
    newest_first = ids[::-1]

    everything = service.client.get("/v1/merges").json()
    assert [job["id"] for job in everything["items"]] == newest_first
    assert everything["next_cursor"] is None

    def pages(**params: Any) -> list[list[str]]:
        found, cursor = [], None
        while True:
            query = {**params, **({"cursor": cursor} if cursor else {})}
            page = service.client.get("/v1/merges", params=query).json()
            found.append([job["id"] for job in page["items"]])
            cursor = page["next_cursor"]
            if cursor is None:
                return found
            assert len(found) < 10, "pagination does not end"

    assert pages(limit=2) == [newest_first[0:2], newest_first[2:4], newest_first[4:5]]
    assert pages(limit=5) == [newest_first]
    succeeded = [i for i in newest_first if i != ids[3]]
    assert pages(limit=1, status="succeeded") == [[i] for i in succeeded]
    assert pages(status="failed") == [[ids[3]]]
    assert pages(status="queued") == [[]]
    assert pages(status="canceled") == [[]]

    # A job submitted while paging does not shift the pages still to come.
    first = service.client.get("/v1/merges", params={"limit": 2}).json()
    late = service.submit(soup())["id"]
    rest = service.client.get(
        "/v1/merges", params={"limit": 10, "cursor": first["next_cursor"]}
    ).json()
    assert [j["id"] for j in first["items"]] + [j["id"] for j in rest["items"]] == newest_first
    assert service.client.get("/v1/merges", params={"limit": 1}).json()["items"][0]["id"] == late
    service.wait(late)


def test_list_filters_by_input_and_output_artifact(service: Service) -> None:
    swap = service.wait(service.submit(layer_swap())["id"])
    mix = service.wait(service.submit(soup("math", "base"))["id"])
    assert swap["status"] == mix["status"] == "succeeded"
    lineage = service.client.get(f"/v1/artifacts/{swap['output']['artifact_id']}/lineage").json()
    by_role = {e["role"]: e["artifact_id"] for e in lineage["jobs"][0]["inputs"]}
    math, swh = by_role["task"], by_role["language"]

    def listed(**params: str) -> list[str]:
        response = service.client.get("/v1/merges", params=params)
        assert response.status_code == 200, response.text
        return [job["id"] for job in response.json()["items"]]

    assert listed(input_artifact=math) == [mix["id"], swap["id"]]  # both read math
    assert listed(input_artifact=swh) == [swap["id"]]
    assert listed(output_artifact=swap["output"]["artifact_id"]) == [swap["id"]]
    assert listed(output_artifact=mix["output"]["artifact_id"]) == [mix["id"]]
    assert listed(input_artifact=swap["output"]["artifact_id"]) == []
    assert listed(output_artifact=math) == []
    assert listed(input_artifact="0" * 32) == []
    assert listed(input_artifact=math, status="failed") == []


# --- cancellation -------------------------------------------------------------------------


@pytest.fixture
def held(
    tmp_path: Path, database_url: str, examples: Path
) -> Iterator[tuple[Service, HeldExecutor]]:
    executor = HeldExecutor()
    with running_service(tmp_path, database_url, examples, job_executor=executor) as running:
        yield running, executor


def test_cancel_a_queued_job(held: tuple[Service, HeldExecutor]) -> None:
    service, executor = held
    job = service.submit(layer_swap())
    assert executor.dispatched == [job["id"]]
    assert service.client.get(f"/v1/merges/{job['id']}").json()["status"] == "queued"

    response = service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert response.status_code == 202, response.text
    assert response.json()["status"] == "canceled"
    now = service.client.get(f"/v1/merges/{job['id']}").json()
    assert now["status"] == "canceled"
    assert now["attempts"] == 0 and now["output"] is None and now["finished_at"]
    assert [e["type"] for e in events_of(service, job["id"])] == ["queued", "canceled"]
    assert not output_dir(service, job).exists()
    assert artifact_entries(service) == []

    again = service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert again.status_code == 409
    assert again.json()["error"]["code"] == "conflict"
    assert again.json()["error"]["details"]["status"] == "canceled"
    assert service.client.get("/v1/merges", params={"status": "canceled"}).json()["items"]


def test_files_of_an_unfinished_analysis_are_409(held: tuple[Service, HeldExecutor]) -> None:
    service, _ = held
    body = {"base": "base", "experts": [{"label": "math", "path": "math"}]}
    job = service.client.post("/v1/analyses", json=body).json()
    for name in ["heatmap.png", "analysis.json"]:
        response = service.client.get(f"/v1/analyses/{job['id']}/{name}")
        assert response.status_code == 409
        assert response.json()["error"]["code"] == "conflict"
    assert service.client.get(f"/v1/analyses/{job['id']}/model.safetensors").status_code == 422


@pytest.fixture(scope="session")
def big_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An 8-layer, 512-wide base and one expert (~55 MB each): a TIES merge of several copies
    takes seconds, long enough to cancel it while it runs."""
    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("big")
    make_checkpoint(root / "big-base", layers=8, hidden=512, intermediate=1536, seed=0)
    make_checkpoint(root / "big-expert", base=root / "big-base", seed=1)
    return root


def link_tree(source: Path, target: Path) -> None:
    """Hard links: the checkpoint appears under the allowed root without copying its bytes."""
    shutil.copytree(source, target, copy_function=os.link)


def test_cancel_a_running_job_leaves_nothing_behind(service: Service, big_family: Path) -> None:
    for name in ("big-base", "big-expert"):
        link_tree(big_family / name, service.checkpoints / name)
    body = {"method": "ties", "base": "big-base", "models": ["big-expert"] * 6}
    job = service.submit({**body, "output": {"name": "never"}})

    running = poll(
        service, job["id"], lambda j: j["status"] == "running" and j["progress"]["bytes_done"] > 0
    )
    assert 0 < running["progress"]["fraction"] < 1
    staging = list((service.settings.artifacts_dir / "default").glob(".never.staging-*"))
    assert staging, "a running merge writes into a staging directory"

    response = service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert response.status_code == 202, response.text
    assert response.json()["status"] in {"canceling", "canceled"}
    done = service.wait(job["id"])
    assert done["status"] == "canceled"
    assert done["output"] is None and done["error"] is None
    assert done["progress"]["bytes_done"] < done["progress"]["bytes_total"]
    types = [e["type"] for e in events_of(service, job["id"])]
    assert types[:2] == ["queued", "running"] and types[-1] == "canceled"
    # A progress event may still land between the request and the merge noticing it.
    assert set(types[types.index("canceling") + 1 : -1]) <= {"progress"}, types
    assert not (service.settings.artifacts_dir / "default" / "never").exists()
    assert artifact_entries(service) == ["default"], "no output, no staging leftovers"
    assert service.client.post(f"/v1/merges/{job['id']}/cancel").status_code == 409


def test_cancel_a_finished_job_is_409(service: Service) -> None:
    job = service.wait(service.submit(layer_swap())["id"])
    assert job["status"] == "succeeded"
    response = service.client.post(f"/v1/merges/{job['id']}/cancel")
    assert response.status_code == 409
    error = response.json()["error"]
    assert error["code"] == "conflict" and error["details"]["status"] == "succeeded"
    after = service.client.get(f"/v1/merges/{job['id']}").json()
    assert after["status"] == "succeeded"
    assert Path(after["output"]["location"]).is_dir()
    assert events_of(service, job["id"])[-1]["type"] == "succeeded"


# --- restart ------------------------------------------------------------------------------


def test_restart_runs_jobs_left_queued(tmp_path: Path, database_url: str, examples: Path) -> None:
    held = HeldExecutor()
    with running_service(tmp_path, database_url, examples, job_executor=held) as first:
        queued = [first.submit(layer_swap())["id"], first.submit(soup())["id"]]
        canceled = first.submit(layer_swap(top=2))["id"]
        assert first.client.post(f"/v1/merges/{canceled}/cancel").status_code == 202
        assert {first.client.get(f"/v1/merges/{i}").json()["status"] for i in queued} == {"queued"}
    with running_service(tmp_path, database_url, examples) as second:
        for job_id in queued:
            job = second.wait(job_id)
            assert job["status"] == "succeeded", job["error"]
            assert job["attempts"] == 1
            assert Path(job["output"]["location"]).is_dir()
            types = [e["type"] for e in events_of(second, job_id)]
            assert types[:2] == ["queued", "running"] and types[-1] == "succeeded"
        still = second.client.get(f"/v1/merges/{canceled}").json()
        assert still["status"] == "canceled" and still["attempts"] == 0


def test_jobs_left_running_by_a_dead_process_are_resumed(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    with running_service(tmp_path, database_url, examples, job_executor=HeldExecutor()) as first:
        orphan = first.submit(layer_swap())
        exhausted = first.submit(soup())["id"]
        winding_down = first.submit(layer_swap(top=2))["id"]
        with first.db.session() as session:  # what a process killed mid-merge leaves
            values = {"status": "running", "stage": "merging", "bytes_done": 1}
            session.execute(update(Job).where(Job.id == orphan["id"]).values(attempts=1, **values))
            session.execute(update(Job).where(Job.id == exhausted).values(attempts=3, **values))
            session.execute(
                update(Job)
                .where(Job.id == winding_down)
                .values(attempts=1, cancel_requested=True, **{**values, "status": "canceling"})
            )
        name = output_dir(first, orphan).name
        stale = (
            output_dir(first, orphan).parent / f".{name}.staging-{orphan['id']}-a1-abcd0123ef45"
        )  # the engine's own naming; its hex may start with a
        stale.mkdir(parents=True)
        (stale / "model-00001-of-00002.safetensors").write_bytes(b"half a shard")

    with running_service(tmp_path, database_url, examples) as second:
        job = second.wait(orphan["id"])
        assert job["status"] == "succeeded", job["error"]
        assert job["attempts"] == 2
        types = [e["type"] for e in events_of(second, orphan["id"])]
        assert types[:3] == ["queued", "queued", "running"]
        assert types[-1] == "succeeded"
        assert not stale.exists(), "the dead attempt's staging directory was cleaned up"

        gave_up = second.client.get(f"/v1/merges/{exhausted}").json()
        assert gave_up["status"] == "failed"
        assert gave_up["error"]["code"] == "attempts_exhausted"
        assert second.client.get(f"/v1/merges/{winding_down}").json()["status"] == "canceled"


# --- events -------------------------------------------------------------------------------


def test_events_json_in_order(service: Service) -> None:
    job = service.submit(layer_swap())
    done = service.wait(job["id"])
    events = events_of(service, job["id"])
    types = [e["type"] for e in events]
    assert types[0] == "queued" and types[1] == "running" and types[-1] == "succeeded"
    assert set(types[2:-1]) == {"progress"}, types
    assert [e["id"] for e in events] == sorted({e["id"] for e in events})
    assert events[1]["data"] == {"attempt": 1}
    last_progress = events[-2]["data"]
    assert last_progress["bytes_done"] == last_progress["bytes_total"] > 0
    assert last_progress["tensors_done"] == last_progress["tensors_total"] > 0
    assert events[-1]["data"]["artifact_id"] == done["output"]["artifact_id"]
    assert events_of(service, job["id"], after=events[1]["id"]) == events[2:]
    assert events_of(service, job["id"], after=events[-1]["id"]) == []


def parse_sse(stream: str) -> list[dict[str, Any]]:
    frames = []
    for block in stream.strip().split("\n\n"):
        fields: dict[str, str] = {}
        for line in block.splitlines():
            name, _, value = line.partition(": ")
            fields[name] = value
        assert set(fields) == {"id", "event", "data"}, block
        frames.append(
            {"id": int(fields["id"]), "event": fields["event"], "data": json.loads(fields["data"])}
        )
    return frames


def test_events_as_server_sent_events_resumable(service: Service) -> None:
    job = service.submit(layer_swap())  # followed while it runs: the stream ends with it
    with service.client.stream(
        "GET", f"/v1/merges/{job['id']}/events", headers={"Accept": "text/event-stream"}
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        assert response.headers["cache-control"] == "no-cache"
        frames = parse_sse(response.read().decode())
    assert frames[0]["event"] == "queued" and frames[-1]["event"] == "succeeded"
    assert service.client.get(f"/v1/merges/{job['id']}").json()["status"] == "succeeded"
    logged = events_of(service, job["id"])
    assert [(f["id"], f["event"]) for f in frames] == [(e["id"], e["type"]) for e in logged]
    assert all(f["data"]["type"] == f["event"] for f in frames)
    assert frames[-1]["data"]["artifact_id"]

    running = next(f["id"] for f in frames if f["event"] == "running")
    resumed = service.client.get(
        f"/v1/merges/{job['id']}/events",
        headers={"Accept": "text/event-stream", "Last-Event-ID": str(running)},
    )
    assert resumed.status_code == 200
    later = parse_sse(resumed.text)
    assert [f["id"] for f in later] == [f["id"] for f in frames if f["id"] > running]
    assert later[-1]["event"] == "succeeded"
    assert "queued" not in {f["event"] for f in later}
    at_end = service.client.get(
        f"/v1/merges/{job['id']}/events",
        headers={"Accept": "text/event-stream", "Last-Event-ID": str(frames[-1]["id"])},
    )
    assert at_end.status_code == 200 and at_end.text.strip() == ""


# --- lineage ------------------------------------------------------------------------------


def test_lineage_several_generations_deep(service: Service) -> None:
    first = service.wait(service.submit({**layer_swap(), "output": {"name": "gen1"}})["id"])
    assert first["status"] == "succeeded", first["error"]
    gen1 = first["output"]
    second = service.wait(
        service.submit(soup(gen1["location"], "swh", output={"name": "gen2"}))["id"]
    )
    assert second["status"] == "succeeded", second["error"]
    gen2 = second["output"]
    third = service.wait(
        service.submit(
            {"method": "task_arithmetic", "base": "base", "models": ["../artifacts/default/gen2"]}
        )["id"]
    )
    assert third["status"] == "succeeded", third["error"]
    gen3 = third["output"]

    ancestors = service.client.get(f"/v1/artifacts/{gen3['artifact_id']}/lineage").json()
    assert ancestors["root"] == gen3["artifact_id"]
    assert ancestors["direction"] == "ancestors"
    jobs = {j["job_id"]: j for j in ancestors["jobs"]}
    assert set(jobs) == {first["id"], second["id"], third["id"]}
    artifacts = {a["id"]: a for a in ancestors["artifacts"]}
    located = {Path(a["location"]).name: a["id"] for a in artifacts.values()}
    assert set(located) == {"base", "math", "swh", "gen1", "gen2", Path(gen3["location"]).name}
    assert located["gen1"] == gen1["artifact_id"]

    # The edges: roles, weights, the recipe and plan digest of each job.
    assert {(e["role"], e["artifact_id"]) for e in jobs[first["id"]]["inputs"]} == {
        ("task", located["math"]),
        ("language", located["swh"]),
    }
    assert {(e["artifact_id"], e["weight"]) for e in jobs[second["id"]]["inputs"]} == {
        (gen1["artifact_id"], 0.5),
        (located["swh"], 0.5),
    }
    assert {(e["role"], e["artifact_id"]) for e in jobs[third["id"]]["inputs"]} == {
        ("base", located["base"]),
        ("model", gen2["artifact_id"]),
    }
    assert jobs[second["id"]]["outputs"] == [
        {"artifact_id": gen2["artifact_id"], "role": "output", "label": "output", "weight": None}
    ]
    assert jobs[second["id"]]["method"] == "soup"
    assert jobs[second["id"]]["recipe"]["models"][0] == gen1["location"]
    assert jobs[second["id"]]["plan_digest"] == second["plan_digest"]
    assert re.fullmatch(r"[0-9a-f]{64}", second["plan_digest"])

    # Output sha256s in the graph are the files on disk.
    for artifact in artifacts.values():
        for entry in artifact["files"]:
            data = (Path(artifact["location"]) / entry["name"]).read_bytes()
            assert hashlib.sha256(data).hexdigest() == entry["sha256"]
    assert (
        service.client.get(f"/v1/artifacts/{gen2['artifact_id']}").json()
        == (artifacts[gen2["artifact_id"]])
    )

    descendants = service.client.get(
        f"/v1/artifacts/{located['swh']}/lineage", params={"direction": "descendants"}
    ).json()
    assert {j["job_id"] for j in descendants["jobs"]} == {first["id"], second["id"], third["id"]}
    assert {a["id"] for a in descendants["artifacts"]} == {
        located["swh"],
        gen1["artifact_id"],
        gen2["artifact_id"],
        gen3["artifact_id"],
    }
    leaf = service.client.get(
        f"/v1/artifacts/{gen3['artifact_id']}/lineage", params={"direction": "descendants"}
    ).json()
    assert leaf["jobs"] == [] and [a["id"] for a in leaf["artifacts"]] == [gen3["artifact_id"]]
    middle = service.client.get(f"/v1/artifacts/{gen1['artifact_id']}/lineage").json()
    assert {j["job_id"] for j in middle["jobs"]} == {first["id"]}

    check_loads_and_runs(Path(gen2["location"]))


def test_a_checkpoint_listed_twice_is_one_input_with_its_total_weight(service: Service) -> None:
    job = service.wait(
        service.submit(soup("math", "math", "swh", params={"weights": [1.0, 1.0, 2.0]}))["id"]
    )
    assert job["status"] == "succeeded", job["error"]
    lineage = service.client.get(f"/v1/artifacts/{job['output']['artifact_id']}/lineage").json()
    (producer,) = lineage["jobs"]
    locations = {a["id"]: Path(a["location"]).name for a in lineage["artifacts"]}
    weights = {locations[e["artifact_id"]]: e["weight"] for e in producer["inputs"]}
    assert weights == {"math": 0.5, "swh": 0.5}
    assert len(producer["inputs"]) == 2


def check_loads_and_runs(location: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(location))
    ids = torch.tensor([[1, 5, 9, 17, 33]])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 5, model.config.vocab_size)
    assert torch.isfinite(logits).all()


# --- analyses, methods, probes, metrics ---------------------------------------------------


def test_analysis_job_serves_heatmap_and_json(service: Service) -> None:
    body = {
        "base": "base",
        "experts": [{"label": "math", "path": "math"}, {"label": "swh", "path": "swh"}],
        "task": "math",
        "language": "swh",
    }
    response = service.client.post("/v1/analyses", json=body)
    assert response.status_code == 202, response.text
    job_id = response.json()["id"]
    assert response.headers["Location"] == f"/v1/analyses/{job_id}"
    done = service.wait(job_id, kind="analyses")
    assert done["status"] == "succeeded", done["error"]
    assert done["kind"] == "analysis"
    assert sorted(done["result"]["files"]) == ["analysis.json", "heatmap.png"]

    png = service.client.get(f"/v1/analyses/{job_id}/heatmap.png")
    assert png.status_code == 200
    assert png.headers["content-type"] == "image/png"
    assert png.content.startswith(PNG_MAGIC) and len(png.content) > 1000

    analysis = service.client.get(f"/v1/analyses/{job_id}/analysis.json")
    assert analysis.status_code == 200
    assert analysis.headers["content-type"].startswith("application/json")
    data = analysis.json()
    assert set(data["experts"]) == {"math", "swh"}
    assert data["layers"] == 6
    suggestion = data["suggestion"]
    assert suggestion["task"] == "math" and suggestion["language"] == "swh"
    assert suggestion["bottom"] >= 0 and suggestion["top"] >= 0
    assert suggestion["bottom"] + suggestion["top"] <= 6
    assert done["result"]["suggestion"] == suggestion
    # An analysis is not a merge.
    assert service.client.get("/v1/merges").json()["items"] == []


def test_methods_list_every_method_with_its_parameters(service: Service) -> None:
    response = service.client.get("/v1/methods")
    assert response.status_code == 200
    methods = {m["method"]: m for m in response.json()}
    sparse = {"dare_ties", "dare_linear", "breadcrumbs", "breadcrumbs_ties", "della",
              "della_linear"}  # fmt: skip
    assert set(methods) == {
        "layer_swap", "soup", "task_arithmetic", "ties", "linear", "slerp", "nuslerp",
        "passthrough", "model_stock", *sparse, "multislerp", "karcher", "nearswap", "sce",
        "arcee_fusion", "ram", "ramplus_tl",
    }  # fmt: skip
    assert {m: methods[m]["base"] for m in methods} == {
        "layer_swap": "optional",
        "soup": "optional",
        "task_arithmetic": "required",
        "ties": "required",
        "linear": "unused",
        "slerp": "unused",
        "nuslerp": "optional",
        "passthrough": "unused",
        "model_stock": "required",
        **dict.fromkeys(sparse, "required"),
        "multislerp": "optional",
        "karcher": "unused",
        **dict.fromkeys(("nearswap", "sce", "arcee_fusion", "ram", "ramplus_tl"), "required"),
    }
    assert methods["layer_swap"]["inputs"] == "experts"
    assert all(methods[m]["inputs"] == "models" for m in set(methods) - {"layer_swap"})
    assert set(methods["slerp"]["params"]) == {"t"}
    assert set(methods["ramplus_tl"]["params"]) == {"epsilon", "r", "alpha"}
    assert set(methods["linear"]["params"]) == {"weights", "normalize"}
    assert set(methods["passthrough"]["params"]) == {"slices", "scale"}
    assert set(methods["nuslerp"]["params"]) == {"weights", "nuslerp_flatten", "nuslerp_row_wise"}
    assert methods["nuslerp"]["params"]["nuslerp_flatten"]["default"] is True
    assert set(methods["model_stock"]["params"]) == {"filter_wise"}
    assert methods["model_stock"]["params"]["filter_wise"]["default"] is False
    swap = methods["layer_swap"]["params"]
    assert set(swap) >= {"bottom", "top", "bottom_transition", "top_transition", "non_layer"}
    assert swap["bottom"]["type"] == "integer"
    assert swap["bottom"]["default"] == 5 and swap["bottom"]["minimum"] == 0
    density = methods["ties"]["params"]["density"]  # a number, or a setting per model
    assert density["default"] == 0.5 and density["anyOf"][0] == {"type": "number"}
    assert density["anyOf"][1]["type"] == "array" and "(0, 1]" in density["description"]
    assert "lambda" in methods["task_arithmetic"]["params"]  # the name a recipe uses
    shared = {"weights", "density", "lambda", "normalize", "rescale", "int8_mask"}
    for name in ("dare_ties", "dare_linear"):
        assert set(methods[name]["params"]) == shared | {"seed"}
    for name in ("breadcrumbs", "breadcrumbs_ties"):
        assert set(methods[name]["params"]) == shared | {"gamma"}
    for name in ("della", "della_linear"):
        assert set(methods[name]["params"]) == shared | {"epsilon", "seed"}
    assert methods["della"]["params"]["normalize"]["default"] is True
    assert methods["della_linear"]["params"]["normalize"]["default"] is False
    assert methods["dare_ties"]["params"]["rescale"]["default"] is True
    assert methods["breadcrumbs"]["params"]["gamma"]["default"] == 0.01
    assert methods["della"]["params"]["epsilon"]["default"] == 0.15
    assert methods["dare_ties"]["params"]["seed"]["default"] == 0
    assert "weights" in methods["soup"]["params"]
    assert methods["passthrough"]["required"] == []  # no slices: its one model, whole
    assert methods["nearswap"]["required"] == ["t"]
    assert set(methods["multislerp"]["params"]) == {"weights", "normalize_weights", "eps"}
    assert methods["karcher"]["params"]["max_iter"]["default"] == 10
    assert methods["sce"]["params"]["select_topk"]["bounds"]["text"] == "[0, 1]"
    assert methods["arcee_fusion"]["params"] == {}
    for method in methods.values():
        assert method["summary"]
        assert method["formula"]
        assert method["needs_base"] == (method["base"] == "required")
        for name, schema in method["params"].items():
            assert "default" in schema or name in method["required"], (method["method"], name)
            assert schema["type_name"] and "per_model" in schema and "bounds" in schema


def test_methods_say_how_each_parameter_varies(service: Service) -> None:
    methods = {m["method"]: m for m in service.client.get("/v1/methods").json()}
    slerp_t = methods["slerp"]["params"]["t"]
    assert (slerp_t["type_name"], slerp_t["varies_by_layer"], slerp_t["per_model"]) == (
        "setting", True, False
    )  # fmt: skip
    weights = methods["linear"]["params"]["weights"]
    assert weights["varies_by_layer"] and weights["per_model"]
    assert methods["ties"]["params"]["weights"]["varies_by_layer"]  # per model, by layer
    assert methods["task_arithmetic"]["params"]["weights"]["varies_by_layer"]
    assert not methods["ties"]["params"]["normalize"]["varies_by_layer"]  # a switch, one value
    density = methods["dare_ties"]["params"]["density"]
    assert density["per_model"] and density["bounds"] == {
        "min": 0, "max": 1, "min_exclusive": True, "max_exclusive": False, "text": "(0, 1]"
    }  # fmt: skip
    assert methods["passthrough"]["layer_stack"] == "restacked"
    assert (methods["slerp"]["models_at_a_time"], methods["linear"]["models_at_a_time"]) == (
        2,
        None,
    )
    assert methods["layer_swap"]["sweep_baseline"] is False
    assert methods["soup"]["mergekit"] is None
    mergekit = methods["ties"]["mergekit"]
    assert mergekit["methods"] == ["ties"]
    parameters = {p["name"]: p for p in mergekit["parameters"]}
    assert parameters["weight"] == {
        "name": "weight", "per_model": True, "required": True, "default": None, "into": "weights"
    }  # fmt: skip
    assert parameters["density"]["default"] == 1.0  # mergekit's, not Layerswap's 0.5
    assert parameters["normalize"]["default"] is True and not parameters["normalize"]["per_model"]


def test_probes(service: Service) -> None:
    for path, body in [("/healthz", {"status": "ok"}), ("/readyz", {"status": "ready"})]:
        response = service.client.get(path)
        assert response.status_code == 200
        assert response.json() == body
    assert service.client.get("/openapi.json").json()["info"]["title"] == "Layerswap"


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_metrics_count_jobs_by_status(vanishing: Service) -> None:
    service = vanishing
    empty = service.client.get("/metrics")
    assert empty.status_code == 200
    assert empty.headers["content-type"].startswith("text/plain")
    assert metric(empty.text, "layerswap_merged_bytes_total") == 0
    assert metric(empty.text, 'layerswap_jobs{kind="merge",status="succeeded"}') is None

    ok = [service.submit(layer_swap())["id"], service.submit(soup())["id"]]
    failed = service.submit(failing(service))["id"]
    for job_id in [*ok, failed]:
        service.wait(job_id)
    text = service.client.get("/metrics").text
    assert metric(text, 'layerswap_jobs{kind="merge",status="succeeded"}') == 2
    assert metric(text, 'layerswap_jobs{kind="merge",status="failed"}') == 1
    assert metric(text, 'layerswap_jobs{kind="merge",status="queued"}') is None
    merged = sum(
        service.client.get(f"/v1/merges/{i}").json()["progress"]["bytes_total"] for i in ok
    )
    assert metric(text, "layerswap_merged_bytes_total") == merged > 0
    assert metric(text, 'layerswap_job_duration_seconds_count{kind="merge"}') == 2
    assert metric(text, 'layerswap_job_duration_seconds_bucket{kind="merge",le="+Inf"}') == 2
    assert "# TYPE layerswap_jobs gauge" in text
    assert metric(text, "layerswap_job_retries_total") == 0
    assert metric(text, "layerswap_redispatches_total") == 0
    assert metric(text, "layerswap_oldest_queued_seconds") == 0
