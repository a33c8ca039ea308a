"""/v1/executor: what runs jobs, as a task monitor shows it: the executor's workers and queue
lengths, and the running jobs with their last heartbeats. The whole service's, every tenant's
work included, so with auth on only the operator token reads it (as /metrics)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from fastapi import APIRouter
from sqlalchemy import func, select

from core import jobs
from core.db.models import Job, as_utc, utcnow
from service.api.deps import Context, ContextDep, OperatorDep

router = APIRouter(prefix="/v1/executor", tags=["meta"])


@router.get("", dependencies=[OperatorDep])
def executor_health(context: ContextDep) -> dict[str, Any]:
    """The executor (`local` or `celery`) and what it reports: its workers (the in-process
    executor's thread, alive or not, and its job; Celery workers take no remote commands, so
    null), its queues' lengths (null while the broker cannot be reached), and for Celery the
    broker's state and the jobs not yet sent to it. With, from the database: the jobs queued,
    and each running job's last heartbeat, `alive` while it is newer than `stale_after_s`."""
    report = getattr(context.executor, "health", None)
    found: dict[str, Any] = (
        report() if callable(report) else {"executor": "other", "workers": None, "queues": None}
    )
    return {**found, **_jobs_seen(context), "stale_after_s": context.settings.stale_after_s}


def _jobs_seen(context: Context) -> dict[str, Any]:
    now = utcnow()
    with context.db.session() as session:
        queued = session.scalar(select(func.count()).where(Job.status == jobs.QUEUED))
        running = session.scalars(
            select(Job).where(Job.status.in_((jobs.RUNNING, jobs.CANCELING))).order_by(Job.id)
        ).all()
        return {
            "queued": queued or 0,
            "running": [running_job(job, now, context.settings.stale_after_s) for job in running],
        }


def running_job(job: Job, now: datetime, stale_after_s: float) -> dict[str, Any]:
    """A running job as the monitor shows it: `alive` while its last heartbeat (or its start)
    is newer than `stale_after_s`."""
    beat = as_utc(job.heartbeat_at) or as_utc(job.started_at)
    silent_s = (now - beat).total_seconds() if beat else None
    return {
        "id": job.id,
        "kind": job.kind,
        "tenant": job.tenant_id,
        "status": job.status,
        "stage": job.stage,
        "attempts": job.attempts,
        "heartbeat_at": beat.isoformat() if beat else None,
        "silent_s": round(silent_s, 3) if silent_s is not None else None,
        "alive": silent_s is not None and silent_s < stale_after_s,
    }
