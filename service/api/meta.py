"""/v1/methods, /healthz, /readyz, /metrics."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import func, select, text

from service.api.deps import ContextDep
from service.api.errors import error_response
from service.db.models import Job, JobEvent, as_utc, utcnow
from worker.engine.recipe import (
    LayerSwapParams,
    SoupParams,
    TaskArithmeticParams,
    TiesParams,
)

router = APIRouter(tags=["meta"])

METHOD_DOCS: dict[str, tuple[str, type[Any], str]] = {
    "layer_swap": (
        "experts",
        LayerSwapParams,
        "bottom/top layers from the language expert, the middle from the task expert",
    ),
    "soup": ("models", SoupParams, "weighted average of checkpoints"),
    "task_arithmetic": ("models", TaskArithmeticParams, "base + λ Σ w_i (T_i − base)"),
    "ties": ("models", TiesParams, "trim, elect sign, disjoint merge (Yadav et al. 2023)"),
}


@router.get("/v1/methods")
def methods() -> list[dict[str, Any]]:
    """Merge methods and their parameters, with types, defaults and ranges (JSON Schema)."""
    listed = []
    for name, (inputs, params, summary) in METHOD_DOCS.items():
        schema = params.model_json_schema(by_alias=True)
        listed.append(
            {
                "method": name,
                "summary": summary,
                "inputs": inputs,
                "base": "required" if name in ("task_arithmetic", "ties") else "optional",
                "params": schema["properties"],
                "definitions": schema.get("$defs", {}),
            }
        )
    return listed


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
def readyz(context: ContextDep) -> dict[str, str] | Response:
    """Ready = the database is reachable and migrated. The broker is reported, not required:
    jobs are accepted while it is down and dispatched when it returns."""
    try:
        with context.db.engine.connect() as connection:
            connection.execute(text("SELECT version_num FROM alembic_version"))  # migrated?
    except Exception:
        return error_response(
            503, "database_unavailable", "the database is unreachable", retry_after=5
        )
    body = {"status": "ready"}
    probe = getattr(context.executor, "broker_reachable", None)
    if callable(probe):
        body["broker"] = "ok" if probe() else "unreachable"
    return body


@router.get("/metrics", response_class=Response)
def metrics(context: ContextDep) -> Response:
    """Prometheus text format, computed from the database so every process agrees."""
    lines = [
        "# HELP layerswap_jobs Jobs by kind and status.",
        "# TYPE layerswap_jobs gauge",
    ]
    with context.db.session() as session:
        counts = session.execute(
            select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)
        ).all()
        merged = session.scalar(
            select(func.coalesce(func.sum(Job.bytes_total), 0)).where(
                Job.kind == "merge", Job.status == "succeeded"
            )
        )
        retries = session.scalar(
            select(func.coalesce(func.sum(Job.attempts - 1), 0)).where(Job.attempts > 1)
        )
        redispatched = session.scalar(
            select(func.count()).select_from(JobEvent).where(JobEvent.type == "redispatched")
        )
        oldest_queued = session.scalar(
            select(func.min(Job.created_at)).where(Job.status == "queued")
        )
        finished = session.execute(
            select(Job.kind, Job.started_at, Job.finished_at).where(
                Job.status == "succeeded", Job.started_at.is_not(None)
            )
        ).all()
    lines += [f'layerswap_jobs{{kind="{k}",status="{s}"}} {n}' for k, s, n in counts]
    lines += [
        "# HELP layerswap_merged_bytes_total Bytes written by succeeded merges.",
        "# TYPE layerswap_merged_bytes_total counter",
        f"layerswap_merged_bytes_total {int(merged or 0)}",
    ]
    waiting = (utcnow() - as_utc(oldest_queued)).total_seconds() if oldest_queued else 0.0
    lines += [
        "# HELP layerswap_job_retries_total Attempts beyond the first (lost workers, restarts).",
        "# TYPE layerswap_job_retries_total counter",
        f"layerswap_job_retries_total {int(retries or 0)}",
        "# HELP layerswap_redispatches_total Queued jobs re-sent after their delivery was lost.",
        "# TYPE layerswap_redispatches_total counter",
        f"layerswap_redispatches_total {int(redispatched or 0)}",
        "# HELP layerswap_oldest_queued_seconds Age of the oldest queued job (0 when none).",
        "# TYPE layerswap_oldest_queued_seconds gauge",
        f"layerswap_oldest_queued_seconds {max(waiting, 0.0):.3f}",
    ]
    lines += _duration_histogram(finished)
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


_BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0)


def _duration_histogram(rows: Any) -> list[str]:
    lines = [
        "# HELP layerswap_job_duration_seconds Run time of succeeded jobs.",
        "# TYPE layerswap_job_duration_seconds histogram",
    ]
    by_kind: dict[str, list[float]] = {}
    for kind, started, finished in rows:
        by_kind.setdefault(kind, []).append((finished - started).total_seconds())
    for kind, values in sorted(by_kind.items()):
        for bucket in _BUCKETS:
            count = sum(v <= bucket for v in values)
            lines.append(
                f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="{bucket}"}} {count}'
            )
        lines.append(
            f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="+Inf"}} {len(values)}'
        )
        lines.append(f'layerswap_job_duration_seconds_sum{{kind="{kind}"}} {sum(values)}')
        lines.append(f'layerswap_job_duration_seconds_count{{kind="{kind}"}} {len(values)}')
    return lines
