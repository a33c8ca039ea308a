"""/v1/evaluations: evaluate a model (an artifact, a local source or a Hub model) with lm-eval;
read the scores, the per-sample records and the events; cancel. Scores of an artifact:
/v1/artifacts/{id}/evaluations."""

from __future__ import annotations

from functools import partial
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse

from core import jobs
from core.errors import Conflict, NotFound
from core.evaluations import (
    EvaluationCreate,
    check_spec,
    evaluation_request,
    link_target,
    samples_file,
    scores_of_job,
    target_of,
)
from service.api import polling
from service.api.deps import ContextDep, TenantDep
from service.api.events import add_events_route
from service.api.polling import CONDITIONAL, WaitQuery
from service.exposure import exposure_for
from service.schemas import JobPage, JobRead, JobView, job_read

router = APIRouter(prefix="/v1/evaluations", tags=["evaluations"])


def read_evaluation(context: Any, job: Any) -> JobView:
    view = job_read(job)
    if job.status == jobs.SUCCEEDED:
        view["result"] = {**(job.result or {}), "scores": scores_of_job(context.db, job)}
    return exposure_for(context.settings).job(view)


@router.post("", status_code=202, response_model=JobRead)
def submit_evaluation(
    body: EvaluationCreate,
    response: Response,
    context: ContextDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobView:
    """Queue an evaluation; tasks, backend and target are checked now (422/501)."""
    check_spec(body.evaluation, context.settings)
    target = target_of(body, context.db, context.settings, tenant)
    new = jobs.NewJob(
        tenant,
        "evaluation",
        evaluation_request(target.target, body.evaluation),
        None,
        idempotency_key,
        asked=body.model_dump(mode="json", exclude_none=True) if target.sources else None,
        sources=target.sources,
    )
    job, created = jobs.submit(context.db, context.settings, new)
    if created:
        link_target(context.db, job)
        context.executor.dispatch(job.id, job.kind)
    response.headers["Location"] = f"/v1/evaluations/{job.id}"
    return read_evaluation(context, job)


@router.get("", response_model=JobPage)
def list_evaluations(
    context: ContextDep,
    tenant: TenantDep,
    status: Annotated[Literal[jobs.STATUSES] | None, Query()] = None,  # type: ignore[valid-type]
    artifact_id: str | None = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> JobPage:
    """Newest first; filter by status or by the artifact evaluated."""
    found, next_cursor = jobs.list_jobs(
        context.db,
        tenant=tenant,
        kind="evaluation",
        status=status,
        artifact=("input", artifact_id) if artifact_id else None,
        cursor=cursor,
        limit=limit,
    )
    return JobPage(items=[read_evaluation(context, j) for j in found], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobRead, responses=CONDITIONAL)
async def get_evaluation(
    job_id: str, request: Request, context: ContextDep, tenant: TenantDep, wait: WaitQuery = None
) -> Response:
    """The evaluation; ETag / If-None-Match and long polling as for merges."""
    return await polling.read_job(
        request,
        context,
        tenant=tenant,
        job_id=job_id,
        kind="evaluation",
        view=partial(read_evaluation, context),
        wait=wait,
        reusable=lambda job: job.status != jobs.SUCCEEDED,  # then its scores are shown too
    )


@router.post("/{job_id}/cancel", status_code=202, response_model=JobRead)
def cancel_evaluation(job_id: str, context: ContextDep, tenant: TenantDep) -> JobView:
    """Cooperative: a running evaluation stops between batches of requests. Once accepted
    (202) it ends `canceled` with no scores; too late, 409 `conflict`: it has ended, or is past
    its point of no return (stage `recording`: writing its scores, card and MLflow tags)."""
    jobs.get(context.db, tenant=tenant, job_id=job_id, kind="evaluation")
    job = jobs.request_cancel(context.db, tenant=tenant, job_id=job_id)
    return read_evaluation(context, job)


@router.get(
    "/{job_id}/samples",
    response_class=FileResponse,
    responses={200: {"content": {"application/x-ndjson": {}}}},
)
def evaluation_samples(job_id: str, context: ContextDep, tenant: TenantDep) -> FileResponse:
    """Per document: prompt, response, extracted answer, target, metrics, correct (JSON lines)."""
    job = jobs.get(context.db, tenant=tenant, job_id=job_id, kind="evaluation")
    if job.status != jobs.SUCCEEDED:
        raise Conflict(f"evaluation {job_id} is {job.status}, not succeeded")
    path = samples_file(context.settings, job)
    if not path.is_file():
        reused = (job.result or {}).get("reused") or []
        raise NotFound(
            f"evaluation {job_id} ran nothing itself: its scores were reused from "
            + ", ".join(sorted({r["job_id"] for r in reused}))
            + " (their samples hold the records)",
            details={"reused": reused},
        )
    return FileResponse(path, media_type="application/x-ndjson", filename=f"{job_id}-samples.jsonl")


add_events_route(router, kind="evaluation")
