"""A job whose process is stopping goes back to the queue (worker/stopping.py): a merge stops at
its first check and leaves no output, its job `queued` again with the same attempts left; a job
being canceled, or given to another attempt, is not touched."""

from __future__ import annotations

import threading
from pathlib import Path

from core import jobs
from core.db.session import Database
from core.settings import Settings
from tests.service.conftest import TENANT
from tests.service.test_store import copy_examples, event_types, job_row, new_job, set_state
from worker.lease import JobLease
from worker.pipeline import run_job
from worker.stopping import hand_back


def test_a_merge_whose_process_is_stopping_goes_back_to_the_queue(
    store: tuple[Database, Settings], examples: Path
) -> None:
    db, settings = store
    copy_examples(settings, examples)
    job_id = new_job(db, settings)
    stopping = threading.Event()
    stopping.set()  # already: the merge stops at its first check

    assert run_job(job_id, db=db, settings=settings, stopping=stopping) is True
    row = job_row(db, job_id)
    assert (row.status, row.stage, row.attempts) == (jobs.QUEUED, None, 1)
    assert row.max_attempts == settings.max_attempts + 1, "a stop uses up no attempt"
    moves = [t for t in event_types(db, job_id) if t != "progress"]
    assert moves == ["queued", "running", "queued"]
    tenant_outputs = settings.artifacts_dir / TENANT
    assert not tenant_outputs.exists() or list(tenant_outputs.iterdir()) == []

    assert run_job(job_id, db=db, settings=settings) is False  # the next delivery runs it
    assert (job_row(db, job_id).status, job_row(db, job_id).attempts) == (jobs.SUCCEEDED, 2)


def test_a_job_being_canceled_or_held_by_another_attempt_is_not_handed_back(
    store: tuple[Database, Settings],
) -> None:
    db, settings = store
    canceling, superseded = new_job(db, settings), new_job(db, settings)
    for job_id in (canceling, superseded):
        assert jobs.claim(db, job_id) == 1
    assert jobs.request_cancel(db, tenant=TENANT, job_id=canceling).status == jobs.CANCELING
    set_state(db, superseded, attempts=2)  # re-queued and claimed again meanwhile

    for job_id, status in ((canceling, jobs.CANCELING), (superseded, jobs.RUNNING)):
        before = event_types(db, job_id)
        assert hand_back(db, JobLease(db, job_id, 1, settings)) is False
        assert job_row(db, job_id).status == status
        assert event_types(db, job_id) == before
