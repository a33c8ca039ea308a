"""/v1/methods, /healthz, /readyz, /metrics."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import APIRouter, Response
from sqlalchemy import ColumnElement, Float, Select, case, cast, extract, func, select, text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from core.db.models import Job, JobEvent, as_utc, utcnow
from engine.methods import METHODS, Method
from engine.schema.params import Range
from engine.translation.translators import Translation
from service.api.deps import Context, ContextDep, OperatorDep
from service.api.errors import error_response, is_database_outage

router = APIRouter(tags=["meta"])
log = logging.getLogger("layerswap.api")


@router.get("/v1/methods")
def methods() -> list[dict[str, Any]]:
    """Merge methods and their parameters, with types, defaults and ranges (JSON Schema), each
    also saying whether it may vary by layer or tensor and whether it is given per model; each
    method's result per tensor, and the mergekit methods it translates with mergekit's
    parameters for them. No key needed: like /openapi.json it is made from the code alone
    (service/app.py)."""
    return [method_view(method) for method in METHODS.values()]


def method_view(method: Method) -> dict[str, Any]:
    schema = method.params.model_json_schema(by_alias=True)
    params = schema["properties"]
    for param in method.parameters():
        params[param.name] |= {
            "type_name": param.type,
            "varies_by_layer": param.varies_by_layer,
            "per_model": param.per_model,
            "bounds": _bounds(param.bounds),
        }
    return {
        "method": method.name,
        "summary": method.summary,
        "formula": method.formula,
        "inputs": method.inputs,
        "base": method.base,
        "needs_base": method.base == "required",
        "layer_stack": method.layer_stack,
        "models_at_a_time": method.at_a_time,  # null: any number
        "sweep_baseline": method.pair_baseline,
        "params": params,
        # the params without a default (passthrough's slices): a recipe must give them
        "required": schema.get("required", []),
        "definitions": schema.get("$defs", {}),
        "mergekit": _mergekit(method.mergekit) if method.mergekit else None,
    }


def _bounds(found: Range | None) -> dict[str, Any] | None:
    if found is None:
        return None
    return {"min": found.low, "max": found.high, "min_exclusive": found.low_open,
            "max_exclusive": found.high_open, "text": str(found)}  # fmt: skip


def _mergekit(translation: Translation) -> dict[str, Any]:
    """The mergekit methods it translates, and mergekit's parameters for them: per model or
    shared, mergekit's default, and the param of the recipe each becomes (null: none)."""
    parameters = [
        {"name": p.name, "per_model": p.per_model, "required": p.required,
         "default": None if p.required else p.default, "into": p.into}
        for p in translation.parameters
    ]  # fmt: skip
    return {"methods": list(translation.names), "parameters": parameters}


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", response_model=None)
def readyz(context: ContextDep) -> dict[str, str] | Response:
    """Ready = the database is reachable and migrated. The broker is reported, not required:
    jobs are accepted while it is down and dispatched when it returns. Only a database outage
    is a 503; any other error is a bug and answers 500 like one."""
    try:
        return readiness(context)
    except DBAPIError as e:
        if not is_database_outage(e):
            raise
        log.warning("not ready: %s", e)
        return error_response(
            503, "database_unavailable", "the database is unreachable", retry_after=5
        )


def readiness(context: Context) -> dict[str, str]:
    with context.db.engine.connect() as connection:
        connection.execute(text("SELECT version_num FROM alembic_version"))  # migrated?
    body = {"status": "ready"}
    probe = getattr(context.executor, "broker_reachable", None)
    if callable(probe):
        body["broker"] = "ok" if probe() else "unreachable"
    return body


@router.get("/metrics", response_class=Response, dependencies=[OperatorDep])
def metrics(context: ContextDep) -> Response:
    """Prometheus text format, computed in the database (aggregates only: the cost does not
    grow with the number of jobs held in memory) so every process agrees. With auth on, only
    the operator token (LAYERSWAP_METRICS_TOKEN) reads it: the counts are every tenant's."""
    with context.db.session() as session:
        lines = _job_lines(session) + _delivery_lines(session)
        durations = session.execute(duration_histogram(context.db.engine.dialect.name)).all()
    lines += _duration_lines(durations)
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _job_lines(session: Session) -> list[str]:
    counts = session.execute(
        select(Job.kind, Job.status, func.count()).group_by(Job.kind, Job.status)
    ).all()
    merged = session.scalar(
        select(func.coalesce(func.sum(Job.bytes_total), 0)).where(
            Job.kind == "merge", Job.status == "succeeded"
        )
    )
    return [
        "# HELP layerswap_jobs Jobs by kind and status.",
        "# TYPE layerswap_jobs gauge",
        *(f'layerswap_jobs{{kind="{k}",status="{s}"}} {n}' for k, s, n in counts),
        "# HELP layerswap_merged_bytes_total Bytes written by succeeded merges.",
        "# TYPE layerswap_merged_bytes_total counter",
        f"layerswap_merged_bytes_total {int(merged or 0)}",
    ]


def _delivery_lines(session: Session) -> list[str]:
    retries = session.scalar(
        select(func.coalesce(func.sum(Job.attempts - 1), 0)).where(Job.attempts > 1)
    )
    redispatched = session.scalar(
        select(func.count()).select_from(JobEvent).where(JobEvent.type == "redispatched")
    )
    oldest_queued = session.scalar(select(func.min(Job.created_at)).where(Job.status == "queued"))
    waiting = (utcnow() - as_utc(oldest_queued)).total_seconds() if oldest_queued else 0.0
    return [
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


# Seconds; evaluations run for hours where merges take minutes.
BUCKETS = (1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0, 4 * 3600.0, 12 * 3600.0)


def duration_seconds(dialect: str) -> ColumnElement[float]:
    """A job's finished_at - started_at in seconds, in SQL."""
    return seconds_between(dialect, Job.started_at, Job.finished_at)


def seconds_between(dialect: str, start: Any, end: Any) -> ColumnElement[float]:
    """end - start in seconds, in SQL (NULL when either is). SQLite's julianday counts whole
    milliseconds; rounding to them removes the float noise of the day fraction."""
    if dialect == "sqlite":
        return func.round((func.julianday(end) - func.julianday(start)) * 86400.0, 3)
    return cast(extract("epoch", end - start), Float)


def duration_histogram(dialect: str) -> Select[*tuple[Any, ...]]:
    """Per kind of succeeded job: the count at or under each bucket, the sum and the count."""
    seconds = duration_seconds(dialect)
    return (
        select(
            Job.kind,
            *(func.sum(case((seconds <= bucket, 1), else_=0)) for bucket in BUCKETS),
            func.sum(seconds),
            func.count(),
        )
        .where(Job.status == "succeeded", Job.started_at.is_not(None))
        .where(Job.finished_at.is_not(None))
        .group_by(Job.kind)
        .order_by(Job.kind)
    )


def _duration_lines(rows: Any) -> list[str]:
    lines = [
        "# HELP layerswap_job_duration_seconds Run time of succeeded jobs.",
        "# TYPE layerswap_job_duration_seconds histogram",
    ]
    for kind, *at_or_under, total, count in rows:
        for bucket, under in zip(BUCKETS, at_or_under, strict=True):
            lines.append(
                f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="{bucket}"}} {under}'
            )
        lines.append(f'layerswap_job_duration_seconds_bucket{{kind="{kind}",le="+Inf"}} {count}')
        lines.append(f'layerswap_job_duration_seconds_sum{{kind="{kind}"}} {float(total)}')
        lines.append(f'layerswap_job_duration_seconds_count{{kind="{kind}"}} {count}')
    return lines
