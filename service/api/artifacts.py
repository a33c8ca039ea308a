"""/v1/artifacts: an artifact, its lineage graph, its stored files (listed with their sizes, and
one by one for download), and deleting it to free space."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any, Literal

from fastapi import APIRouter, Response
from fastapi.responses import FileResponse

from core import jobs
from core.db.models import Artifact
from core.errors import Forbidden, InvalidRequest, NotFound
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


@router.get("/{artifact_id}/files")
def list_artifact_files(artifact_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """A stored artifact's files (an output's or an analysis's): name, sha256 and size in
    bytes (null for a file missing on disk). 404 for an input the service only read, and for
    a deleted artifact."""
    artifact = _stored(get_artifact(context.db, tenant=tenant, artifact_id=artifact_id))
    root = Path(artifact.location)
    files = [
        {"name": name, "sha256": sha, "size": _size(root, name)}
        for name, sha in sorted(artifact.files.items())
    ]
    return {"artifact_id": artifact.id, "files": files}


@router.get(
    "/{artifact_id}/files/{name:path}",
    response_class=FileResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def read_artifact_file(
    artifact_id: str, name: str, context: ContextDep, tenant: TenantDep
) -> FileResponse:
    """One of a stored artifact's files, streamed (as an attachment). Only a file the artifact
    records, inside its directory: a name that is absolute or climbs (`..`) is a 422, one that
    leads out of the directory (a symbolic link) a 403."""
    artifact = _stored(get_artifact(context.db, tenant=tenant, artifact_id=artifact_id))
    path = confined_file(Path(artifact.location), name, recorded=artifact.files)
    return FileResponse(path, filename=PurePosixPath(name).name)


def _stored(artifact: Artifact) -> Artifact:
    if artifact.deleted_at is not None:
        raise NotFound(f"artifact {artifact.id}: its files were deleted")
    if artifact.size_bytes is None:
        raise NotFound(f"artifact {artifact.id} is an input the service read, not one it stored")
    return artifact


def confined_file(root: Path, name: str, *, recorded: dict[str, Any]) -> Path:
    """The regular file `name` of the directory `root`, after following links; raises
    unless `name` is relative, never climbs, is one of `recorded`, and stays inside `root`."""
    parts = PurePosixPath(name).parts
    if not parts or name.startswith("/") or "\\" in name or ".." in parts:
        raise InvalidRequest(f"{name!r}: a file is named relative to its artifact, without '..'")
    if name not in recorded:
        raise NotFound(f"the artifact has no file {name!r}")
    inside = root.resolve()
    path = (inside / name).resolve()
    if not path.is_relative_to(inside):
        raise Forbidden(f"{name!r} leads outside the artifact's directory")
    if not path.is_file():
        raise NotFound(f"the artifact's file {name!r} is missing on disk")
    return path


def _size(root: Path, name: str) -> int | None:
    try:
        return confined_file(root, name, recorded={name: None}).stat().st_size
    except (NotFound, Forbidden, InvalidRequest, OSError):
        return None


@router.delete("/{artifact_id}", status_code=204, response_class=Response)
def remove_artifact(artifact_id: str, context: ContextDep, tenant: TenantDep) -> Response:
    """Remove a stored output's or analysis's files; the artifact stays in lineage, marked
    deleted, and its name can be used again. 409 while an unfinished job reads or writes it."""
    delete_artifact(context.db, context.settings, tenant=tenant, artifact_id=artifact_id)
    return Response(status_code=204)
