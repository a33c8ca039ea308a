"""Cancel: a cancel that was accepted (202) ends the job `canceled` with nothing left behind (no
output directory, artifact, lineage, Hub commit or success webhook); one that comes too late
(the job ended, or passed its point of no return) answers 409 and the job ends as it would
have. The cancel check sees the flag between tensors without waiting for the heartbeat. The
in-process executor, on SQLite and on PostgreSQL."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import event, func, select

from core import jobs
from core.db.models import Artifact, Job, LineageEdge, WebhookEvent, utcnow
from core.db.session import Database
from core.errors import Conflict
from core.settings import Settings
from engine.errors import MergeCanceled
from tests.helpers import leftovers, wait_for
from tests.service.conftest import TERMINAL, Service, layer_swap, running_service
from tests.service.test_api_lifecycle import HeldExecutor
from tests.stuck_server import StuckServer
from tests.webhooks.receiver import Receiver
from worker.lease import JobLease, settle_succeeded

TOKEN = "hf_team_a_cancel_token_0123456789"
# The heartbeat alone would see a cancel only after this long: the cancel check must not wait.
SLOW_HEARTBEAT: dict[str, Any] = {"heartbeat_interval_s": 60.0, "stale_after_s": 600.0}


# --- the lease: the cancel check and the compare-and-sets that end a job --------------------


def running_job(db: Database, settings: Settings, **lease_settings: Any) -> JobLease:
    """A merge job claimed by attempt 1, and that attempt's lease (its heartbeat not started)."""
    job, _ = jobs.submit(db, settings, jobs.NewJob("default", "merge", layer_swap(), None, None))
    attempt = jobs.claim(db, job.id)
    assert attempt == 1
    return JobLease(db, job.id, attempt, settings.model_copy(update=lease_settings))


def row(db: Database, job_id: str) -> Job:
    with db.session() as session:
        found = session.get(Job, job_id)
        assert found is not None
        return found


def event_types(db: Database, job_id: str) -> list[str]:
    return [e.type for e in jobs.events(db, tenant="default", job_id=job_id)]


def test_a_running_job_sees_a_cancel_without_waiting_for_its_heartbeat(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    with running_job(db, settings, cancel_check_interval_s=0.01, **SLOW_HEARTBEAT) as lease:
        assert not lease.should_cancel()
        jobs.request_cancel(db, tenant="default", job_id=lease.job_id)
        wait_for(lease.should_cancel, "the cancel check to see the cancel", 20)


def test_the_cancel_check_reads_the_database_at_most_once_per_interval(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    lease = running_job(db, settings, cancel_check_interval_s=3600.0)
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_: Any) -> None:
        statements.append(statement)

    event.listen(db.engine, "before_cursor_execute", count)
    try:
        for _ in range(1000):  # the engine asks between every two tensors
            assert not lease.should_cancel()
    finally:
        event.remove(db.engine, "before_cursor_execute", count)
    reads = [s for s in statements if "cancel_requested" in s]
    assert len(reads) == 1, statements


def test_success_is_refused_once_a_cancel_was_accepted(store: tuple[Database, Settings]) -> None:
    db, settings = store
    lease = running_job(db, settings)
    asked = jobs.request_cancel(db, tenant="default", job_id=lease.job_id)
    assert asked.status == "canceling"
    with db.session() as session, pytest.raises(MergeCanceled):
        settle_succeeded(session, lease, finished_at=utcnow(), stage=None)
    with pytest.raises(MergeCanceled):
        lease.commit_point("committing")
    assert row(db, lease.job_id).status == "canceling"
    assert event_types(db, lease.job_id) == ["queued", "running", "canceling"]


def test_a_cancel_after_the_point_of_no_return_answers_409(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    lease = running_job(db, settings)
    lease.commit_point("committing")
    lease.commit_point("committing")  # a retried publish passes it again
    with pytest.raises(Conflict) as refused:
        jobs.request_cancel(db, tenant="default", job_id=lease.job_id)
    assert refused.value.details == {"status": "running", "stage": "committing"}
    assert "point of no return" in refused.value.message
    lease.set_stage("merging")  # a late stage write cannot reopen the window
    assert (row(db, lease.job_id).stage, row(db, lease.job_id).cancel_requested) == (
        "committing",
        False,
    )
    with db.session() as session:
        settle_succeeded(session, lease, finished_at=utcnow(), stage=None)
    with pytest.raises(Conflict) as ended:
        jobs.request_cancel(db, tenant="default", job_id=lease.job_id)
    assert ended.value.details == {"status": "succeeded"}
    assert row(db, lease.job_id).status == "succeeded"


# --- merges through the API ----------------------------------------------------------------


def cancel(service: Service, job_id: str, kind: str = "merges") -> Any:
    return service.client.post(f"/v1/{kind}/{job_id}/cancel")


def api_events(service: Service, job_id: str) -> list[str]:
    response = service.client.get(f"/v1/merges/{job_id}/events")
    assert response.status_code == 200, response.text
    return [e["type"] for e in response.json()]


def count(db: Database, model: Any) -> int:
    with db.session() as session:
        return int(session.scalar(select(func.count()).select_from(model)) or 0)


def assert_left_nothing(service: Service, job: dict[str, Any]) -> None:
    """Canceled through `canceling`, and no trace of an output: directory (or staging copy),
    artifact row, lineage edge, or a webhook other than the end's."""
    done = service.client.get(f"/v1/merges/{job['id']}").json()
    assert done["status"] == "canceled", done
    assert done["output"] is None and done["error"] is None
    assert api_events(service, job["id"])[-2:] == ["canceling", "canceled"]
    out = service.settings.artifacts_dir / "default" / job["request"]["output"]["name"]
    assert leftovers(out) == []
    assert count(service.db, Artifact) == 0 and count(service.db, LineageEdge) == 0
    with service.db.session() as session:
        sent = session.scalars(
            select(WebhookEvent.type).where(WebhookEvent.subject_id == job["id"])
        )
        assert list(sent) in ([], ["merge.canceled"])


@pytest.fixture(scope="session")
def medium(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/math/swh of ≈60 MB each (float32): a TIES merge of them takes a good fraction of a
    second, time to cancel it as it starts and as it merges."""
    import torch

    from worker.examples import make_checkpoint

    root = tmp_path_factory.mktemp("medium")
    base = make_checkpoint(
        root / "base", layers=6, hidden=384, intermediate=1536, vocab=4096, heads=8, kv_heads=4,
        dtype=torch.float32,
    )  # fmt: skip
    make_checkpoint(root / "math", base=base, seed=1, dtype=torch.float32)
    make_checkpoint(root / "swh", base=base, seed=2, dtype=torch.float32)
    return root


def ties(family: Path, name: str) -> dict[str, Any]:
    return {
        "method": "ties",
        "base": str(family / "base"),
        "models": [str(family / "math"), str(family / "swh")],
        "params": {"density": 0.3},
        "output": {"name": name},
    }


def started(job: dict[str, Any]) -> bool:
    return bool(job["status"] == "running")


def merging(job: dict[str, Any]) -> bool:
    progress = job.get("progress") or {}
    done, total = progress.get("bytes_done") or 0, progress.get("bytes_total") or 0
    return job["status"] == "running" and 0 < done < total / 2


def until(service: Service, job_id: str, condition: Callable[[dict[str, Any]], bool]) -> None:
    def met() -> bool:
        job = dict(service.client.get(f"/v1/merges/{job_id}").json())
        assert job["status"] not in TERMINAL, f"job {job_id} ended {job['status']} first"
        return condition(job)

    wait_for(met, f"job {job_id} to be caught", 120, interval=0.005)


@pytest.mark.parametrize("point", [started, merging], ids=["as-it-starts", "while-merging"])
def test_a_merge_canceled_while_running_ends_canceled_with_nothing_left(
    tmp_path: Path,
    database_url: str,
    examples: Path,
    medium: Path,
    point: Callable[[dict[str, Any]], bool],
) -> None:
    data = tmp_path / "data"
    roots = [data / "checkpoints", data / "artifacts", medium]
    with running_service(
        tmp_path, database_url, examples, allowed_roots=roots, **SLOW_HEARTBEAT
    ) as service:
        job = service.submit(ties(medium, "never"))
        until(service, job["id"], point)
        answer = cancel(service, job["id"])
        assert answer.status_code == 202, answer.text
        assert answer.json()["status"] == "canceling"
        service.wait(job["id"])
        assert_left_nothing(service, job)


@pytest.fixture
def hub_service(
    tmp_path: Path, database_url: str, examples: Path, hub: Any
) -> Iterator[tuple[Service, Receiver]]:
    """The service with a Hub credential for team-a and a webhook endpoint for every event."""
    hub.add_token(TOKEN, user="team-a", read=["team-a/*"], write=["team-a/*"])
    receiver = Receiver().start()
    try:
        with running_service(
            tmp_path, database_url, examples, hub_credentials={"default": {"team-a": TOKEN}},
            webhook_allowed_networks=["127.0.0.0/8"], webhook_interval_s=0.05,
        ) as service:  # fmt: skip
            created = service.client.post("/v1/webhooks", json={"url": receiver.url})
            assert created.status_code == 201, created.text
            receiver.secrets.append(created.json()["secret"])
            yield service, receiver
    finally:
        receiver.stop()


def test_a_cancel_accepted_while_publishing_ends_canceled_with_nothing_left(
    hub_service: tuple[Service, Receiver], hub: Any
) -> None:
    """The Hub holds the first upload unanswered: the merge is renamed into place and being
    published, its commit not made. The cancel is accepted, and once the upload ends the job
    stops before the commit: no commit, no output, no artifact, no lineage, and the only
    webhook is merge.canceled. A later merge may take the name; a cancel after it succeeded
    answers 409 and changes nothing."""
    service, _ = hub_service
    held = hub.hold_upload()
    hub_output = {"repo": "team-a/held", "credential": "team-a"}
    body = {**layer_swap(), "output": {"name": "held", "hub": hub_output}}
    job = service.submit(body)
    wait_for(held.reached.is_set, "the job's first upload to reach the Hub", 120)
    assert service.client.get(f"/v1/merges/{job['id']}").json()["stage"] == "publishing"
    answer = cancel(service, job["id"])
    assert answer.status_code == 202, answer.text
    assert answer.json()["status"] == "canceling"
    held.release()
    service.wait(job["id"])
    assert_left_nothing(service, job)
    assert not any(job["id"] in commit.title for commit in hub.commits("team-a/held"))
    with service.db.session() as session:
        sent = session.scalars(
            select(WebhookEvent.type).where(WebhookEvent.subject_id == job["id"])
        )
        assert list(sent) == ["merge.canceled"]

    again = service.wait(service.submit({**layer_swap(), "output": {"name": "held"}})["id"])
    assert again["status"] == "succeeded", again["error"]
    late = cancel(service, again["id"])
    assert late.status_code == 409, late.text
    assert late.json()["error"]["code"] == "conflict"
    assert late.json()["error"]["details"] == {"status": "succeeded"}
    after = service.client.get(f"/v1/merges/{again['id']}").json()
    assert after["status"] == "succeeded" and after["output"] == again["output"]
    assert api_events(service, again["id"])[-1] == "succeeded"
    assert (service.settings.artifacts_dir / "default" / "held" / "layerswap.json").is_file()


def test_a_cancel_while_registering_is_too_late(
    tmp_path: Path, examples: Path, database_url: str
) -> None:
    """Registering with MLflow is past the point of no return: the cancel answers 409 naming
    the stage, and the job ends as registering ends (here: failed, the registry never
    answers), never canceled."""
    with (
        StuckServer("silent") as registry,
        running_service(
            tmp_path, database_url, examples,
            mlflow_tracking_uri=registry.url, mlflow_timeout_s=8.0,
        ) as service,
    ):  # fmt: skip
        body = {**layer_swap(), "output": {"name": "registered",
                                           "mlflow": {"registered_model": "m"}}}  # fmt: skip
        job = service.submit(body)
        until(service, job["id"], lambda seen: seen["stage"] == "registering")
        answer = cancel(service, job["id"])
        assert answer.status_code == 409, answer.text
        error = answer.json()["error"]
        assert error["code"] == "conflict" and "point of no return" in error["message"]
        assert error["details"] == {"status": "running", "stage": "registering"}
        done = service.wait(job["id"], timeout=60)
    assert done["status"] == "failed" and done["error"]["code"] == "mlflow_failed"
    assert "canceling" not in api_events(service, job["id"])


def test_an_evaluation_past_its_point_of_no_return_cannot_be_canceled(
    tmp_path: Path, examples: Path, database_url: str
) -> None:
    """The evaluation's attempt has passed its point of no return (stage `recording`: the
    scores go to the card, the Hub and MLflow): its cancel answers 409 and the job stays
    running, its cancel flag unset."""
    from tests.evaluation.test_api import EVALUATION

    with running_service(
        tmp_path, database_url, examples, job_executor=HeldExecutor(),
        eval_data_dir=examples / "eval-data",
    ) as service:  # fmt: skip
        submitted = service.client.post(
            "/v1/evaluations", json={"source": "math", "evaluation": EVALUATION}
        )
        assert submitted.status_code == 202, submitted.text
        job_id = submitted.json()["id"]
        attempt = jobs.claim(service.db, job_id)
        assert attempt == 1
        JobLease(service.db, job_id, attempt, service.settings).commit_point("recording")
        answer = cancel(service, job_id, "evaluations")
        assert answer.status_code == 409, answer.text
        assert answer.json()["error"]["details"] == {"status": "running", "stage": "recording"}
        assert (row(service.db, job_id).status, row(service.db, job_id).cancel_requested) == (
            "running",
            False,
        )


# --- the experiment: many merges, canceled at random points ---------------------------------

POINTS: dict[str, Callable[[dict[str, Any], list[str]], bool]] = {
    "submitted": lambda job, events: True,
    "running": lambda job, events: "running" in events,
    "progress": lambda job, events: "progress" in events,
    "written": lambda job, events: (
        job["progress"] is not None
        and job["progress"]["bytes_done"] == job["progress"]["bytes_total"] > 0
    ),
    "ended": lambda job, events: job["status"] in TERMINAL,
}


def test_merges_canceled_at_random_points_end_as_their_cancel_answered(
    tmp_path: Path, database_url: str, examples: Path
) -> None:
    """Ten merges, each canceled at one of the points (as submitted, once running, at its first
    progress, once every byte is written, after it ended) in an order drawn at random, with the
    default heartbeat: each cancel answered 202 ends `canceled` with no output, each answered
    409 ends `succeeded` with its output. Never 202 and then succeeded."""
    points = random.Random(20240613).sample(list(POINTS) * 2, 2 * len(POINTS))
    with running_service(tmp_path, database_url, examples, heartbeat_interval_s=2.0) as service:
        for trial, point in enumerate(points):
            job = service.submit({**layer_swap(), "output": {"name": f"trial-{trial}"}})
            reached = POINTS[point]

            def caught(job_id: str = job["id"], reached: Any = reached) -> bool:
                seen = dict(service.client.get(f"/v1/merges/{job_id}").json())
                return bool(reached(seen, api_events(service, job_id)))

            wait_for(caught, f"trial {trial} to reach {point}", 60, interval=0.002)
            answer = cancel(service, job["id"])
            done = service.wait(job["id"])
            outcome = (answer.status_code, done["status"])
            assert outcome in ((202, "canceled"), (409, "succeeded")), (trial, point, outcome)
            out = service.settings.artifacts_dir / "default" / f"trial-{trial}"
            if done["status"] == "canceled":
                assert done["output"] is None and leftovers(out) == []
                assert api_events(service, job["id"])[-1] == "canceled"
            else:
                assert done["output"] is not None and leftovers(out) == [out.name]
