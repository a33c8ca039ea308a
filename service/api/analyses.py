"""/v1/analyses: the engine's delta analysis as a job; its JSON and heatmap PNG, and its events."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import FileResponse

from core import jobs
from core.errors import Conflict, NotFound
from core.lineage import analysis_dir, get_artifact
from core.sources import resolve_source
from service.api import polling
from service.api.deps import ContextDep, TenantDep
from service.api.events import add_events_route
from service.api.polling import CONDITIONAL, WaitQuery
from service.exposure import exposure_for
from service.schemas import AnalysisCreate, JobRead, JobView, job_read

router = APIRouter(prefix="/v1/analyses", tags=["analyses"])


@router.post("", status_code=202, response_model=JobRead)
def submit_analysis(
    body: AnalysisCreate,
    response: Response,
    context: ContextDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> JobView:
    resolve_source(body.base, context.settings, tenant, field="base")
    for i, expert in enumerate(body.experts):
        resolve_source(expert.path, context.settings, tenant, field=f"experts.{i}.path")
    new = jobs.NewJob(tenant, "analysis", body.model_dump(), None, idempotency_key)
    job, created = jobs.submit(context.db, context.settings, new)
    if created:
        context.executor.dispatch(job.id, job.kind)
    response.headers["Location"] = f"/v1/analyses/{job.id}"
    return exposure_for(context.settings).job(job_read(job))


@router.get("/{job_id}", response_model=JobRead, responses=CONDITIONAL)
async def get_analysis(
    job_id: str, request: Request, context: ContextDep, tenant: TenantDep, wait: WaitQuery = None
) -> Response:
    """The analysis; ETag / If-None-Match and long polling as for merges."""
    shown = exposure_for(context.settings)  # its result names where its files lie
    return await polling.read_job(
        request, context, tenant=tenant, job_id=job_id, kind="analysis",
        view=lambda job: shown.job(job_read(job)), wait=wait,
        reusable=lambda _: True,  # job_read shows the job's row alone
    )  # fmt: skip


add_events_route(router, kind="analysis")  # before /{job_id}/{filename}, which would match it


@router.get(
    "/{job_id}/{filename}",
    response_class=FileResponse,
    responses={200: {"content": {"image/png": {}, "application/json": {}}}},
)
def analysis_file(
    job_id: str,
    filename: Literal["heatmap.png", "analysis.json"],
    context: ContextDep,
    tenant: TenantDep,
) -> FileResponse:
    job = jobs.get(context.db, tenant=tenant, job_id=job_id, kind="analysis")
    if job.status != jobs.SUCCEEDED:
        raise Conflict(f"analysis {job_id} is {job.status}, not succeeded")
    if job.output_artifact_id is not None:
        artifact = get_artifact(context.db, tenant=tenant, artifact_id=job.output_artifact_id)
        if artifact.deleted_at is not None:
            raise NotFound(f"analysis {job_id}: its files were deleted (artifact {artifact.id})")
    media = "image/png" if filename.endswith(".png") else "application/json"
    return FileResponse(analysis_dir(context.settings, job) / filename, media_type=media)
