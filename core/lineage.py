"""Artifacts and the lineage graph: artifact -> job -> artifact, many generations deep."""

from __future__ import annotations

import logging
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db.models import Artifact, Job, LineageEdge, as_utc, utcnow
from core.db.session import Database
from core.errors import Conflict, NotFound, ServiceError
from core.evaluations import score_dict, scores_of_artifact
from core.hub.refs import is_hub_source
from core.jobs import CANCELING, QUEUED, RUNNING, is_id, new_id, output_dir
from core.kinds import kind_of
from core.settings import Settings
from core.sources import resolve_source
from engine.io.digests import content_digest

log = logging.getLogger("layerswap.lineage")


class NotDeletable(ServiceError):
    """409: only what the service stored (merge outputs, analyses) can be deleted through it;
    an input checkpoint belongs to whoever put it there."""

    code = "artifact_not_deletable"
    status = 409


def get_or_create_artifact(
    session: Session, *, tenant: str, location: Path | str, files: dict[str, str], **extra: Any
) -> Artifact:
    """The artifact at `location` with these files: the same content, or (a merge's output
    read as an input, identified by its weights and config only) a superset of them."""
    digest = content_digest(files)
    here = session.scalars(
        select(Artifact)
        .where(
            Artifact.tenant_id == tenant,
            Artifact.location == str(location),
            Artifact.deleted_at.is_(None),  # a new output under a deleted one's name is new
        )
        .order_by(Artifact.created_at)
    ).all()
    for found in sorted(here, key=lambda a: a.content_digest != digest):
        if found.content_digest == digest or (
            files and all(found.files.get(name) == sha for name, sha in files.items())
        ):
            return found
    artifact = Artifact(
        id=new_id(),
        tenant_id=tenant,
        kind=extra.pop("kind", "checkpoint"),
        location=str(location),
        content_digest=digest,
        files=files,
        **extra,
    )
    session.add(artifact)
    session.flush()
    return artifact


def stored_size(location: Path, files: dict[str, str]) -> int:
    """Bytes of an artifact the service wrote (what counts against its tenant's quota)."""
    return sum((location / name).stat().st_size for name in files)


@dataclass(frozen=True)
class InputLink:
    artifact: Artifact
    role: str
    label: str
    weight: float | None


def link(session: Session, job: Job, inputs: list[InputLink], output: Artifact) -> None:
    # One edge per (artifact, role): a checkpoint listed twice (a soup of [a, a]) is one input
    # whose weight is the sum of its entries' weights.
    edges: dict[tuple[str, str], LineageEdge] = {}
    for item in inputs:
        edge = edges.get((item.artifact.id, item.role))
        if edge is not None:
            if edge.weight is not None and item.weight is not None:
                edge.weight += item.weight
            else:
                edge.weight = None
            continue
        edges[(item.artifact.id, item.role)] = edge = LineageEdge(
            job_id=job.id,
            artifact_id=item.artifact.id,
            direction="input",
            role=item.role,
            label=item.label,
            weight=item.weight,
        )
        session.add(edge)
    session.add(
        LineageEdge(
            job_id=job.id,
            artifact_id=output.id,
            direction="output",
            role="output",
            label="output",
            weight=None,
        )
    )


def get_artifact(db: Database, *, tenant: str, artifact_id: str) -> Artifact:
    with db.session() as session:
        artifact = session.get(Artifact, artifact_id) if is_id(artifact_id) else None
        if artifact is None or artifact.tenant_id != tenant:
            raise NotFound(f"no such artifact: {artifact_id}")
        return artifact


def graph(db: Database, *, tenant: str, artifact_id: str, direction: str) -> dict[str, Any]:
    """Breadth-first walk of the lineage from one artifact, towards its ancestors (the
    inputs of the job that made it, and theirs...) or its descendants."""
    get_artifact(db, tenant=tenant, artifact_id=artifact_id)
    nodes: dict[str, Artifact] = {}
    jobs: dict[str, dict[str, Any]] = {}
    frontier = deque([artifact_id])
    with db.session() as session:
        while frontier:
            current = frontier.popleft()
            if current in nodes:
                continue
            artifact = session.get(Artifact, current)
            assert artifact is not None
            nodes[current] = artifact
            towards = "output" if direction == "ancestors" else "input"
            for edge in session.scalars(
                select(LineageEdge).where(
                    LineageEdge.artifact_id == current, LineageEdge.direction == towards
                )
            ):
                if edge.job_id in jobs:
                    continue
                jobs[edge.job_id] = _job_node(session, edge.job_id)
                side = "input" if direction == "ancestors" else "output"
                frontier.extend(e["artifact_id"] for e in jobs[edge.job_id][f"{side}s"])
    return {
        "root": artifact_id,
        "direction": direction,
        "artifacts": [{**artifact_dict(a), "scores": _scores(db, a)} for a in nodes.values()],
        "jobs": list(jobs.values()),
    }


def _job_node(session: Session, job_id: str) -> dict[str, Any]:
    job = session.get(Job, job_id)
    assert job is not None
    edges = list(session.scalars(select(LineageEdge).where(LineageEdge.job_id == job_id)))
    return {
        "job_id": job.id,
        "kind": job.kind,
        "method": job.request.get("method"),
        "recipe": job.request,
        "plan_digest": job.plan_digest,
        "inputs": [_edge(e) for e in edges if e.direction == "input"],
        "outputs": [_edge(e) for e in edges if e.direction == "output"],
    }


def _edge(edge: LineageEdge) -> dict[str, Any]:
    return {
        "artifact_id": edge.artifact_id,
        "role": edge.role,
        "label": edge.label,
        "weight": edge.weight,
    }


def _scores(db: Database, artifact: Artifact) -> list[dict[str, Any]]:
    """The evaluation scores measured on an artifact (newest of each kind)."""
    return [score_dict(s) for s in scores_of_artifact(db, artifact.tenant_id, artifact.id)]


def artifact_dict(artifact: Artifact) -> dict[str, Any]:
    return {
        "id": artifact.id,
        "kind": artifact.kind,
        "location": artifact.location,
        "content_digest": artifact.content_digest,
        "architecture": artifact.architecture,
        "num_layers": artifact.num_layers,
        "files": [{"name": n, "sha256": s} for n, s in sorted(artifact.files.items())],
        "published": artifact.published or [],
        "created_at": as_utc(artifact.created_at).isoformat(),
        "size_bytes": artifact.size_bytes,
        "deleted_at": deleted.isoformat() if (deleted := as_utc(artifact.deleted_at)) else None,
    }


def analysis_dir(settings: Settings, job: Job) -> Path:
    """Where a finished analysis's files are: the location it recorded, or, for analyses from
    before that was recorded, where they were written then."""
    stored = (job.result or {}).get("location")
    if isinstance(stored, str):
        return Path(stored)
    return settings.artifacts_dir / job.tenant_id / "analyses" / job.id


def analyses_root(settings: Settings) -> Path:
    """Where analyses are stored: beside the artifacts directory, not in it, since each tenant's
    part of that is the namespace of its merge outputs (one may be named `analyses`) and a
    source root."""
    return settings.artifacts_dir.parent / "analyses"


def delete_artifact(db: Database, settings: Settings, *, tenant: str, artifact_id: str) -> None:
    """Remove a stored artifact's files and mark it deleted (its row stays: lineage still shows
    it). 404 for another tenant's; 409 while a queued or running job reads or writes it, or
    for an input the service did not store. Deleting a deleted artifact changes nothing.

    Not serialised with submits: a job submitted in the instant between this check and the
    files' removal (its own source check saw them) fails with its source missing."""
    with db.session() as session:
        artifact = session.get(Artifact, artifact_id) if is_id(artifact_id) else None
        if artifact is None or artifact.tenant_id != tenant:
            raise NotFound(f"no such artifact: {artifact_id}")
        location = Path(artifact.location)
        if artifact.deleted_at is not None:
            return
        if not _stored(settings, tenant, location):
            raise NotDeletable(
                f"artifact {artifact_id} is an input the service did not store; it cannot be "
                "deleted through the API",
                details={"location": artifact.location},
            )
        if busy := _jobs_using(session, settings, tenant, location):
            raise Conflict(
                f"artifact {artifact_id} is in use by {len(busy)} unfinished job(s)",
                details={"jobs": busy},
            )
        session.execute(
            update(Artifact)
            .where(Artifact.id == artifact_id, Artifact.deleted_at.is_(None))
            .values(deleted_at=utcnow())
        )
    # After the commit: a crash in between leaves files that no longer count, not a live
    # artifact without its files.
    shutil.rmtree(location, ignore_errors=True)
    if location.exists():
        log.warning("artifact %s: deleted, but %s could not be removed", artifact_id, location)


def _stored(settings: Settings, tenant: str, location: Path) -> bool:
    return any(
        location.is_relative_to(root) and location != root
        for root in (settings.artifacts_dir / tenant, analyses_root(settings) / tenant)
    )


def _jobs_using(session: Session, settings: Settings, tenant: str, location: Path) -> list[str]:
    """Unfinished jobs of the tenant that write `location` (their output) or read it."""
    unfinished = session.scalars(
        select(Job).where(Job.tenant_id == tenant, Job.status.in_((QUEUED, RUNNING, CANCELING)))
    )
    real = location.resolve()
    return [
        job.id
        for job in unfinished
        if (job.kind == "merge" and output_dir(settings, job) == location)
        or real in _local_sources(job, settings)
    ]


def _local_sources(job: Job, settings: Settings) -> set[Path]:
    sources = kind_of(job.kind).sources(job.request)
    found = set()
    for source in sources:
        if is_hub_source(source):
            continue
        try:
            found.add(resolve_source(source, settings, job.tenant_id, must_exist=False))
        except ServiceError:
            continue  # a source no longer allowed reads nothing here
    return found
