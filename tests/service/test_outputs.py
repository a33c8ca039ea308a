"""Outputs on disk across jobs and attempts: leftovers matched by the engine's exact names,
analyses in a namespace of their own, outputs orphaned by a job that ended without succeeding,
and a full disk outside the engine. Real files, real tmpfs, SQLite and PostgreSQL."""

from __future__ import annotations

import errno
import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import update

from core import jobs
from core.db.models import Job, utcnow
from core.db.session import Database
from core.errors import Conflict
from core.settings import Settings
from engine.merge import MergeOptions, merge
from engine.recipe import parse_recipe
from service.reconciler import Reconciler
from tests.service.conftest import Service, layer_swap
from tests.service.test_reconciler import RecordingExecutor
from tests.service.test_store import (
    TENANT,
    copy_examples,
    job_row,
    new_job,
    set_state,
)
from worker.outputs import remove_leftovers
from worker.pipeline import run_job

HEX = "0123456789ab"  # the engine's 12 hex digits (engine/merge.py)


def output_owner(out_dir: Path) -> str | None:
    """The job its manifest names (read here, not through the code under test)."""
    try:
        return str(json.loads((out_dir / "layerswap.json").read_text())["job"]["id"])
    except FileNotFoundError:
        return None


def test_leftovers_are_matched_by_the_engines_exact_names(tmp_path: Path) -> None:
    """Job J1 writes output `m` (attempt 2 now); job J2, alive, writes `m.old-x`, whose
    staging and swapped-out names start like `m`'s own `.m.old-*`."""
    j1, j2 = "1" * 32, "2" * 32
    names = {
        f".m.staging-{j1}-a1-{HEX}": False,  # J1's dead attempt 1
        f".m.staging-{j1}-a2-{HEX}": True,  # J1's attempt 2: this one
        f".m.staging-{j1}-a10-{HEX}": True,  # a later attempt, not an earlier one
        f".m.old-{HEX}": False,  # m swapped out by J1 and not yet removed
        "m.old-x": True,  # J2's output
        f".m.old-x.staging-{j2}-a1-{HEX}": True,  # J2's live staging
        f".m.old-x.old-{HEX}": True,  # J2's swap
        f".m.old-{HEX}.staging-{j2}-a1-{HEX}": True,  # an output named m.old-<hex>
        f".m.staging-{j1}-a1-{HEX}-more": True,  # not a name the engine makes
    }
    for name in names:
        (tmp_path / name).mkdir()
        (tmp_path / name / "model.safetensors").write_bytes(b"x")

    remove_leftovers(tmp_path / "m", j1, attempt=2)

    assert {p.name for p in tmp_path.iterdir()} == {n for n, kept in names.items() if kept}


# --- analyses and an output named `analyses` ---------------------------------------------

ANALYSIS = {"base": "base", "experts": [{"label": "math", "path": "math"}]}


def test_an_output_named_analyses_does_not_meet_the_analyses(service: Service) -> None:
    first = service.client.post("/v1/analyses", json=ANALYSIS).json()
    assert service.wait(first["id"], kind="analyses")["status"] == "succeeded"

    named = service.submit({**layer_swap(), "output": {"name": "analyses"}})
    merged = service.wait(named["id"])
    assert merged["status"] == "succeeded", merged["error"]
    second = service.client.post("/v1/analyses", json=ANALYSIS).json()
    done = service.wait(second["id"], kind="analyses")
    assert done["status"] == "succeeded", done["error"]

    out_dir = Path(merged["output"]["location"])
    assert out_dir == service.settings.artifacts_dir / "default" / "analyses"
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        f["name"] for f in merged["output"]["files"]
    )  # no analysis inside the merge output
    for job in (first, second):
        location = Path(
            dict(service.client.get(f"/v1/analyses/{job['id']}").json())["result"]["location"]
        )
        assert not location.is_relative_to(service.settings.artifacts_dir)
        png = service.client.get(f"/v1/analyses/{job['id']}/heatmap.png")
        assert png.status_code == 200 and png.content == (location / "heatmap.png").read_bytes()


def test_an_analysis_from_before_keeps_its_location(service: Service) -> None:
    """Analyses finished before their location was recorded lie where they were written then
    (artifacts/<tenant>/analyses/<id>), and are still served from there."""
    job = service.client.post("/v1/analyses", json=ANALYSIS).json()
    done = service.wait(job["id"], kind="analyses")
    legacy = service.settings.artifacts_dir / "default" / "analyses" / job["id"]
    shutil.move(done["result"]["location"], legacy)
    old_result = {k: v for k, v in done["result"].items() if k not in ("location", "artifact_id")}
    with service.db.session() as session:
        session.execute(
            update(Job)
            .where(Job.id == job["id"])
            .values(result=old_result, output_artifact_id=None)
        )
    served = service.client.get(f"/v1/analyses/{job['id']}/analysis.json")
    assert served.status_code == 200
    assert served.content == (legacy / "analysis.json").read_bytes()


# --- outputs orphaned by a job that ended without succeeding -------------------------------


def publish_as_attempt(db: Database, settings: Settings, job_id: str, attempt: int) -> Path:
    """What an attempt that published and was then lost leaves: a complete output whose
    manifest names the job, and no record of it."""
    job = job_row(db, job_id)
    out_dir = jobs.output_dir(settings, job)
    checkpoints = settings.source_roots[0]
    merge(
        parse_recipe(job.request),
        out_dir,
        resolve=lambda s: checkpoints / s,
        options=MergeOptions(durable=False, job={"id": job_id, "attempt": attempt}),
    )
    assert output_owner(out_dir) == job_id
    return out_dir


def lose_attempt(db: Database, settings: Settings, job_id: str) -> None:
    set_state(db, job_id, heartbeat_at=utcnow() - timedelta(seconds=settings.stale_after_s + 5))


@pytest.mark.parametrize("ending", ["attempts_exhausted", "canceled"])
def test_the_reconciler_removes_the_output_of_a_job_it_ends(
    store: tuple[Database, Settings],
    examples: Path,
    ending: str,
) -> None:
    db, settings = store
    copy_examples(settings, examples)
    job_id = new_job(db, settings)
    assert jobs.claim(db, job_id) == 1
    out_dir = publish_as_attempt(db, settings, job_id, 1)
    if ending == "canceled":
        jobs.request_cancel(db, tenant=TENANT, job_id=job_id)
    else:
        set_state(db, job_id, attempts=settings.max_attempts)
    lose_attempt(db, settings, job_id)

    Reconciler(db, settings, RecordingExecutor()).run_once()

    row = job_row(db, job_id)
    assert row.status == (jobs.CANCELED if ending == "canceled" else jobs.FAILED)
    assert not out_dir.exists()
    assert list(out_dir.parent.iterdir()) == []


def test_the_reconciler_leaves_another_jobs_output(
    store: tuple[Database, Settings],
    examples: Path,
) -> None:
    """A job that ends without succeeding under a name another job's output holds: that
    output is not its to remove."""
    db, settings = store
    copy_examples(settings, examples)
    winner = new_job(db, settings)
    name = job_row(db, winner).output_name
    loser, _ = jobs.submit(db, settings, jobs.NewJob(TENANT, "merge", layer_swap(), name, None))
    run_job(winner, db=db, settings=settings)
    assert job_row(db, winner).status == jobs.SUCCEEDED
    assert jobs.claim(db, loser.id) == 1
    set_state(db, loser.id, attempts=settings.max_attempts)
    lose_attempt(db, settings, loser.id)

    Reconciler(db, settings, RecordingExecutor()).run_once()

    assert job_row(db, loser.id).status == jobs.FAILED
    out_dir = jobs.output_dir(settings, job_row(db, winner))
    assert output_owner(out_dir) == winner and (out_dir / "config.json").is_file()


def test_a_name_held_by_an_orphan_can_be_asked_for_again(
    store: tuple[Database, Settings],
    examples: Path,
) -> None:
    """An orphan the reconciler did not remove (it ended in a process that stopped, or before
    this version): the next submit under its name removes it; a live job's or a succeeded
    job's output still holds its name."""
    db, settings = store
    copy_examples(settings, examples)

    def submit(name: str) -> Any:
        return jobs.submit(db, settings, jobs.NewJob(TENANT, "merge", layer_swap(), name, None))

    orphaned, _ = submit("orphan")
    assert jobs.claim(db, orphaned.id) == 1
    publish_as_attempt(db, settings, orphaned.id, 1)
    set_state(db, orphaned.id, status=jobs.FAILED)
    requeued, _ = submit("requeued")
    publish_as_attempt(db, settings, requeued.id, 1)  # its next attempt will adopt this
    succeeded, _ = submit("kept")
    run_job(succeeded.id, db=db, settings=settings)

    again, created = submit("orphan")
    assert created and not jobs.output_dir(settings, again).exists()
    run_job(again.id, db=db, settings=settings)
    assert job_row(db, again.id).status == jobs.SUCCEEDED
    for name, owner in [("requeued", requeued.id), ("kept", succeeded.id)]:
        with pytest.raises(Conflict) as refused:
            submit(name)
        assert refused.value.details == {"field": "output.name"}
        assert output_owner(settings.artifacts_dir / TENANT / name) == owner


# --- a full disk outside the engine --------------------------------------------------------


def fill(directory: Path) -> None:
    """Write until the filesystem refuses: from here on every write there is ENOSPC."""
    with (directory / "filler").open("wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    with pytest.raises(OSError) as full:
        (directory / "probe").write_bytes(b"\0" * 8192)
    assert full.value.errno == errno.ENOSPC


def test_an_analysis_on_a_full_disk_fails_as_disk_full(
    service: Service, small_filesystem: Any
) -> None:
    tiny = small_filesystem(256 * 1024)
    fill(tiny)
    os.symlink(tiny, service.settings.artifacts_dir.parent / "analyses")

    job = service.client.post("/v1/analyses", json=ANALYSIS).json()
    done = service.wait(job["id"], kind="analyses")

    assert done["status"] == "failed"
    assert done["error"]["code"] == "disk_full", done["error"]
    assert "no space left" in done["error"]["message"]
    assert done["attempts"] == 1  # not retried: it would fail the same way
