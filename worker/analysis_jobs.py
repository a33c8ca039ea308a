"""Delta analysis as a job: the engine's analysis, written under the analyses directory and
recorded as an artifact of kind `analysis` (so DELETE /v1/artifacts/{id} frees its space)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from core import jobs
from core.db.models import Job, utcnow
from core.db.session import Database
from core.lineage import analyses_root, get_or_create_artifact, stored_size
from core.settings import Settings
from core.sources import file_guard, resolve_source
from engine.analysis.files import write_analysis
from engine.io.digests import file_sha256
from worker.lease import JobLease, settle, write_with_retry


@dataclass(frozen=True)
class Analysis:
    location: Path
    files: dict[str, str]  # name -> sha256
    summary: dict[str, Any]


def run_analysis(job: Job, settings: Settings) -> Analysis:
    # torch: loaded by the first analysis, not by every process that can run jobs (the API's
    # in-process executor among them)
    from engine.analysis.deltas import analyze

    request = job.request
    tenant = job.tenant_id
    experts = [
        (e["label"], resolve_source(e["path"], settings, tenant, field=f"experts.{i}.path"))
        for i, e in enumerate(request["experts"])
    ]
    result = analyze(
        base=resolve_source(request["base"], settings, tenant, field="base"),
        experts=experts,
        threshold=request.get("threshold"),
        task=request.get("task"),
        language=request.get("language"),
        guard=file_guard(settings, tenant),
    )
    out = analyses_root(settings) / tenant / job.id
    written = write_analysis(result, out)
    data = result.to_json()
    summary = {
        "files": [p.name for p in written],
        "suggestion": data.get("suggestion"),
        "threshold": data.get("threshold"),
        "location": str(out),
    }
    return Analysis(out, {p.name: file_sha256(p) for p in written}, summary)


def record_analysis(session: Session, lease: JobLease, job: Job, analysis: Analysis) -> None:
    """The attempt's end: succeeded (compare-and-set), with the files as an artifact."""
    row = settle(session, lease, status=jobs.SUCCEEDED, finished_at=utcnow(), stage=None)
    artifact = get_or_create_artifact(
        session,
        tenant=job.tenant_id,
        location=analysis.location,
        files=analysis.files,
        kind="analysis",
        size_bytes=stored_size(analysis.location, analysis.files),
    )
    row.output_artifact_id = artifact.id
    row.result = {**analysis.summary, "artifact_id": artifact.id}
    jobs.add_event(session, job.id, jobs.SUCCEEDED, artifact_id=artifact.id)


def run_analysis_job(job: Job, db: Database, settings: Settings, lease: JobLease) -> None:
    analysis = run_analysis(job, settings)
    write_with_retry(
        db,
        lease,
        lambda session: record_analysis(session, lease, job, analysis),
        settings.db_retry_s,
    )
