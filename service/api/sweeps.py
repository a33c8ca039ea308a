"""/v1/sweeps: create (idempotent), list, read with progress and trials, cancel, and the
leaderboard as JSON, CSV, Markdown or a PNG plot."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Response
from sqlalchemy import select

from core.db.models import Sweep
from core.errors import NotFound
from core.jobs import is_id
from service.api.deps import Context, ContextDep, TenantDep
from service.sweeps.advance import cancel_sweep
from service.sweeps.create import create_sweep
from service.sweeps.leaderboard import leaderboard, to_csv, to_markdown, to_png
from service.sweeps.spec import SweepCreate
from service.sweeps.view import sweep_view

router = APIRouter(prefix="/v1/sweeps", tags=["sweeps"])


def _get(context: Context, tenant: str, sweep_id: str) -> Sweep:
    with context.db.session() as session:
        sweep = session.get(Sweep, sweep_id) if is_id(sweep_id) else None
        if sweep is None or sweep.tenant_id != tenant:
            raise NotFound(f"no such sweep: {sweep_id}")
        session.expunge(sweep)
        return sweep


@router.post("", status_code=202)
def submit_sweep(
    body: SweepCreate,
    response: Response,
    context: ContextDep,
    tenant: TenantDep,
    idempotency_key: Annotated[str | None, Header(min_length=1, max_length=200)] = None,
) -> dict[str, Any]:
    """Expand the sweep, check everything a worker would (422 naming the field, or stating the
    job count when it exceeds the budget), and queue its merge and evaluation jobs."""
    created = create_sweep(context.db, context.settings, tenant, body, idempotency_key)
    for job_id, kind in created.job_ids:
        context.executor.dispatch(job_id, kind)
    response.headers["Location"] = f"/v1/sweeps/{created.sweep.id}"
    return sweep_view(context.db, created.sweep)


@router.get("")
def list_sweeps(
    context: ContextDep,
    tenant: TenantDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> dict[str, Any]:
    """Newest first, without their trials."""
    with context.db.session() as session:
        found = list(
            session.scalars(
                select(Sweep)
                .where(Sweep.tenant_id == tenant)
                .order_by(Sweep.created_at.desc(), Sweep.id.desc())
                .limit(limit)
            )
        )
        for sweep in found:
            session.expunge(sweep)
    return {"items": [sweep_view(context.db, s, trials=False) for s in found]}


@router.get("/{sweep_id}")
def get_sweep(sweep_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    return sweep_view(context.db, _get(context, tenant, sweep_id))


@router.post("/{sweep_id}/cancel", status_code=202)
def cancel(sweep_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """Cancels the sweep's queued and running jobs (the reconciler does it within one round);
    409 once the sweep has ended."""
    return sweep_view(context.db, cancel_sweep(context.db, tenant=tenant, sweep_id=sweep_id))


@router.get(
    "/{sweep_id}/leaderboard",
    responses={200: {"content": {"application/json": {}, "text/csv": {}, "text/markdown": {}}}},
)
def get_leaderboard(
    sweep_id: str,
    context: ContextDep,
    tenant: TenantDep,
    format: Literal["json", "csv", "markdown"] = "json",
) -> Any:
    """Per configuration: mean, min, max over pairs, stderr and 95 % interval, rank, and a
    paired test against the best; per pair, each configuration beside both experts. Partial
    while the sweep runs."""
    board = leaderboard(context.db, context.settings, _get(context, tenant, sweep_id))
    if format == "csv":
        return Response(to_csv(board), media_type="text/csv")
    if format == "markdown":
        return Response(to_markdown(board), media_type="text/markdown")
    return board


@router.get(
    "/{sweep_id}/leaderboard.png",
    response_class=Response,
    responses={200: {"content": {"image/png": {}}}},
)
def leaderboard_png(sweep_id: str, context: ContextDep, tenant: TenantDep) -> Response:
    sweep = _get(context, tenant, sweep_id)
    board = leaderboard(context.db, context.settings, sweep)
    pairs = SweepCreate.model_validate(sweep.request).expert_pairs()
    return Response(to_png(board, pairs), media_type="image/png")
