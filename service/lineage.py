"""Artifacts and the lineage graph: artifact -> job -> artifact, many generations deep."""

from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.db.models import Artifact, Job, LineageEdge, as_utc
from service.db.session import Database
from service.errors import NotFound
from service.jobs import is_id, new_id


def content_digest(files: dict[str, str]) -> str:
    """One digest over a checkpoint's file sha256s: same files, same identity."""
    lines = "".join(f"{name}\0{sha}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def get_or_create_artifact(
    session: Session, *, tenant: str, location: Path | str, files: dict[str, str], **extra: Any
) -> Artifact:
    """The artifact at `location` with these files: the same content, or (a merge's output
    read as an input, identified by its weights and config only) a superset of them."""
    digest = content_digest(files)
    here = session.scalars(
        select(Artifact)
        .where(Artifact.tenant_id == tenant, Artifact.location == str(location))
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
        "artifacts": [artifact_dict(a) for a in nodes.values()],
        "jobs": list(jobs.values()),
    }


def _job_node(session: Session, job_id: str) -> dict[str, Any]:
    job = session.get(Job, job_id)
    assert job is not None
    edges = list(session.scalars(select(LineageEdge).where(LineageEdge.job_id == job_id)))
    return {
        "job_id": job.id,
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
    }
