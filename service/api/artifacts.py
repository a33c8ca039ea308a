"""/v1/artifacts: an artifact and its lineage graph."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter

from service.api.deps import ContextDep, TenantDep
from service.lineage import artifact_dict, get_artifact, graph

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
