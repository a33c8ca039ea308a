"""/v1/artifacts: an artifact, its lineage graph, and deleting it to free space."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Response

from core import jobs
from core.evaluations import score_dict, scores_of_artifact
from core.lineage import artifact_dict, delete_artifact, get_artifact, graph
from service.api.deps import ContextDep, TenantDep
from service.exposure import exposure_for

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])


@router.get("/{artifact_id}")
def read_artifact(artifact_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """The artifact, with the newest evaluation score of each task, filter and metric (as its
    node in lineage graphs shows it)."""
    artifact = get_artifact(context.db, tenant=tenant, artifact_id=artifact_id)
    scores = scores_of_artifact(context.db, tenant, artifact_id)
    shown = exposure_for(context.settings)  # its location is a server path
    found: dict[str, Any] = shown.value(
        {**artifact_dict(artifact), "scores": [score_dict(s) for s in scores]}
    )
    return found


@router.get("/{artifact_id}/lineage")
def read_lineage(
    artifact_id: str,
    context: ContextDep,
    tenant: TenantDep,
    direction: Literal["ancestors", "descendants"] = "ancestors",
) -> dict[str, Any]:
    """Every artifact and job reachable from this one, several generations deep."""
    found = graph(context.db, tenant=tenant, artifact_id=artifact_id, direction=direction)
    shown: dict[str, Any] = exposure_for(context.settings).value(found)  # artifact locations
    return shown


@router.get("/{artifact_id}/evaluations")
def artifact_evaluations(
    artifact_id: str, context: ContextDep, tenant: TenantDep
) -> dict[str, Any]:
    """Every score measured on the artifact (the newest of each task, filter, metric and
    settings) and the evaluation jobs that asked about it, newest first."""
    get_artifact(context.db, tenant=tenant, artifact_id=artifact_id)
    found, _ = jobs.list_jobs(
        context.db, tenant=tenant, kind="evaluation", status=None,
        artifact=("input", artifact_id), cursor=None, limit=200,
    )  # fmt: skip
    return {
        "artifact_id": artifact_id,
        "scores": [score_dict(s) for s in scores_of_artifact(context.db, tenant, artifact_id)],
        "evaluations": [{"id": j.id, "status": j.status} for j in found],
    }


@router.delete("/{artifact_id}", status_code=204, response_class=Response)
def remove_artifact(artifact_id: str, context: ContextDep, tenant: TenantDep) -> Response:
    """Remove a stored output's or analysis's files; the artifact stays in lineage, marked
    deleted, and its name can be used again. 409 while an unfinished job reads or writes it."""
    delete_artifact(context.db, context.settings, tenant=tenant, artifact_id=artifact_id)
    return Response(status_code=204)
