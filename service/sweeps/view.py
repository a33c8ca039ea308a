"""What GET /v1/sweeps/{id} shows: the sweep, progress over all its jobs, and each trial."""

from __future__ import annotations

from typing import Any

from core import jobs
from core.db.models import Job, Sweep, as_utc
from core.db.session import Database
from core.evaluations import scores_of_job
from service.sweeps.leaderboard import children, objective_score
from service.sweeps.spec import SweepCreate


def sweep_view(db: Database, sweep: Sweep, *, trials: bool = True) -> dict[str, Any]:
    found = children(db, sweep.id)
    by_status: dict[str, int] = {}
    for job in found:
        by_status[job.status] = by_status.get(job.status, 0) + 1
    ended = sum(n for status, n in by_status.items() if status in jobs.TERMINAL)
    view: dict[str, Any] = {
        "id": sweep.id,
        "status": sweep.status,
        "created_at": as_utc(sweep.created_at).isoformat(),
        "finished_at": finished.isoformat() if (finished := as_utc(sweep.finished_at)) else None,
        "num_layers": sweep.num_layers,
        "request": sweep.request,
        "result": sweep.result,
        "progress": {
            "jobs": len(found),
            "ended": ended,
            "by_status": by_status,
            "fraction": ended / len(found) if found else 0.0,
        },
    }
    if trials:
        view["trials"] = _trials(db, sweep, found)
    return view


def _trials(db: Database, sweep: Sweep, found: list[Job]) -> list[dict[str, Any]]:
    spec = SweepCreate.model_validate(sweep.request)
    evaluation_of = {
        job.request.get("merge_job_id"): job for job in found if job.kind == "evaluation"
    }
    merges = {job.id for job in found if job.kind == "merge"}
    listed = []
    for job in found:
        trial = job.request.get("sweep") or {}
        if job.kind == "evaluation" and job.request.get("merge_job_id") in merges:
            continue  # shown with its merge
        evaluation = job if job.kind == "evaluation" else evaluation_of.get(job.id)
        score = None
        if evaluation is not None and evaluation.status == jobs.SUCCEEDED:
            found_score = objective_score(scores_of_job(db, evaluation), spec)
            score = found_score["value"] if found_score else None
        listed.append(
            {
                "config": trial.get("config"),
                "pair": trial.get("pair"),
                "merge_job_id": job.id if job.kind == "merge" else None,
                "merge_status": job.status if job.kind == "merge" else None,
                "artifact_id": job.output_artifact_id if job.kind == "merge" else None,
                "evaluation_job_id": evaluation.id if evaluation is not None else None,
                "evaluation_status": evaluation.status if evaluation is not None else None,
                "score": score,
                "in_memory": job.kind == "evaluation" and "layer_swap" in job.request["target"],
                "kept": bool(trial.get("kept")),  # the best configuration, written at the end
                "published_to": trial.get("published_to"),
            }
        )
    return listed
