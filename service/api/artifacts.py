"""/v1/artifacts: an artifact, its lineage graph, and deleting it to free space."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Response

from service.api.deps import ContextDep, TenantDep
from service.lineage import artifact_dict, delete_artifact, get_artifact, graph

router = APIRouter(prefix="/v1/artifacts", tags=["artifacts"])


@router.get("/{artifact_id}")
def read_artifact(artifact_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    return artifact_dict(get_artifact(context.db, tenant=tenant, artifact_id=artifact_id))


@router.get("/{artifact_id}/lineage")
def read_lineage(
    artifact_id: str,
    context: ContextDep,
    tenant: TenantDep,
    direction: Literal["ancestors", "descendants"] = "ancestors",
) -> dict[str, Any]:
    """Every artifact and job reachable from this one, several generations deep."""
    return graph(context.db, tenant=tenant, artifact_id=artifact_id, direction=direction)


@router.delete("/{artifact_id}", status_code=204, response_class=Response)
def remove_artifact(artifact_id: str, context: ContextDep, tenant: TenantDep) -> Response:
    """Remove a stored output's or analysis's files; the artifact stays in lineage, marked
    deleted, and its name can be used again. 409 while an unfinished job reads or writes it."""
    delete_artifact(context.db, context.settings, tenant=tenant, artifact_id=artifact_id)
    return Response(status_code=204)
