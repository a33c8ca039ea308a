"""A job whose process is stopping goes back to the queue within seconds.

A worker told to stop (SIGTERM: `docker stop`, `compose down`, a rolling upgrade) could finish
its running job first, but a merge or an evaluation can take the better part of an hour, and
no orchestrator waits that long. It could be cut off, but then its job waits for the
reconciler to find its heartbeat stale, and the job loses one of its attempts. So the stop
is seen where a cancel is (JobLease.should_cancel: between tensors, download chunks and
evaluation steps), the attempt ends as a canceled one does, leaving no partial output, and
one compare-and-set puts the job back to `queued`, at once, for the next worker. A stop is not
a loss: the job keeps every one of its LAYERSWAP_MAX_ATTEMPTS for lost attempts.
"""

from __future__ import annotations

import logging
from typing import Any

from core import jobs
from core.db.models import Job
from core.db.session import Database
from worker.lease import JobLease

log = logging.getLogger("layerswap.pipeline")


def hand_back(db: Database, lease: JobLease) -> bool:
    """Put the attempt's job back to `queued` (fenced like every write of the attempt), with
    its event; whether it was. Not when the job is canceling (a cancel asked meanwhile: the
    caller ends it canceled) or is no longer this attempt's. One try: the database errors it
    raises are the caller's, whose process stops all the same, and whose job the reconciler
    then re-queues once its heartbeat is stale."""
    with db.session() as session:
        moved: Any = session.execute(
            lease.fenced()
            .where(Job.status == jobs.RUNNING)
            .values(status=jobs.QUEUED, stage=None, max_attempts=Job.max_attempts + 1)
        )
        if int(moved.rowcount) != 1:
            return False
        jobs.add_event(
            session, lease.job_id, jobs.QUEUED,
            reason="re-queued: its worker stopped", attempt=lease.attempt,
        )  # fmt: skip
    log.info("job %s: attempt %d handed back to the queue (stopping)", lease.job_id, lease.attempt)
    return True
