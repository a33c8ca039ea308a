"""Delta analysis as a job: the engine's analysis, written under the artifacts directory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.db.models import Job
from service.settings import Settings
from service.sources import resolve_source


def analysis_dir(settings: Settings, job: Job) -> Path:
    return settings.artifacts_dir / job.tenant_id / "analyses" / job.id


def run_analysis(job: Job, settings: Settings) -> dict[str, Any]:
    from worker.engine.analysis import analyze

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
    )
    out = analysis_dir(settings, job)
    written = result.write(out)
    data = result.to_json()
    return {
        "files": [p.name for p in written],
        "suggestion": data.get("suggestion"),
        "threshold": data.get("threshold"),
    }
