"""run_job: the one function that executes a job, whichever executor delivered it.

claim (compare-and-set) -> plan -> merge, writing progress at a bounded rate -> record the
output artifact and its lineage -> succeeded | failed | canceled.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from sqlalchemy import update

from service import jobs
from service.db.models import Job, utcnow
from service.db.session import Database
from service.errors import ServiceError
from service.lineage import InputLink, get_or_create_artifact, link
from service.settings import Settings
from service.sources import resolve_source
from worker.engine.errors import EngineError, MergeCanceled
from worker.engine.progress import Progress

log = logging.getLogger("layerswap.pipeline")
EVENT_INTERVAL_S = 2.0


class JobReporter:
    """Progress into the job row (at most every `interval` seconds) and the cancel flag."""

    def __init__(self, db: Database, job_id: str, interval: float) -> None:
        self.db, self.job_id, self.interval = db, job_id, interval
        self._written = self._event = self._checked = 0.0
        self._cancel = False

    def progress(self, p: Progress) -> None:
        now = time.monotonic()
        if now - self._written < self.interval and p.bytes_done < p.bytes_total:
            return
        self._written = now
        with self.db.session() as session:
            session.execute(
                update(Job)
                .where(Job.id == self.job_id)
                .values(
                    stage=p.stage,
                    bytes_done=p.bytes_done,
                    bytes_total=p.bytes_total,
                    tensors_done=p.tensors_done,
                    tensors_total=p.tensors_total,
                    heartbeat_at=utcnow(),
                )
            )
            if now - self._event >= EVENT_INTERVAL_S or p.bytes_done >= p.bytes_total:
                self._event = now
                jobs.add_event(
                    session,
                    self.job_id,
                    "progress",
                    stage=p.stage,
                    bytes_done=p.bytes_done,
                    bytes_total=p.bytes_total,
                    tensors_done=p.tensors_done,
                    tensors_total=p.tensors_total,
                )

    def should_cancel(self) -> bool:
        now = time.monotonic()
        if not self._cancel and now - self._checked >= self.interval:
            self._checked = now
            with self.db.session() as session:
                job = session.get(Job, self.job_id)
                self._cancel = job is None or job.cancel_requested
        return self._cancel


def run_job(job_id: str, *, db: Database, settings: Settings) -> None:
    """Execute one job if this caller wins the claim; never raises for job failures."""
    if not jobs.claim(db, job_id):
        return
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
    reporter = JobReporter(db, job_id, settings.progress_interval_s)
    try:
        if job.kind == "merge":
            _run_merge(job, db, settings, reporter)
        else:
            from worker.analysis_jobs import run_analysis

            result = run_analysis(job, settings)
            _finish(db, job_id, jobs.SUCCEEDED, result=result)
    except MergeCanceled:
        _finish(db, job_id, jobs.CANCELED)
    except (EngineError, ServiceError) as e:
        _finish(db, job_id, jobs.FAILED, error=_error_dict(e))
    except Exception:
        log.exception("job %s failed unexpectedly", job_id)
        error = {"code": "internal_error", "message": "unexpected error; see the service log"}
        _finish(db, job_id, jobs.FAILED, error=error)


def _error_dict(error: EngineError | ServiceError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "details": error.details}


def _finish(db: Database, job_id: str, status: str, **values: Any) -> None:
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
        job.status, job.finished_at, job.stage = status, utcnow(), None
        for key, value in values.items():
            setattr(job, key, value)
        jobs.add_event(session, job_id, status, **(values.get("error") or {}))


def _run_merge(job: Job, db: Database, settings: Settings, reporter: JobReporter) -> None:
    from worker.engine.merge import MergeOptions, merge
    from worker.engine.recipe import parse_recipe

    recipe = parse_recipe(job.request)
    out_dir = jobs.output_dir(settings, job)
    _remove_leftovers(out_dir)
    options = MergeOptions(
        device=settings.merge_device,
        hash_cache=settings.cache_dir / "sha256",
        overwrite=job.attempts > 1,
    )
    result = merge(
        recipe,
        out_dir,
        resolve=lambda s: resolve_source(s, settings, job.tenant_id),
        options=options,
        on_progress=reporter.progress,
        should_cancel=reporter.should_cancel,
    )
    manifest = result.manifest
    with db.session() as session:
        row = session.get(Job, job.id)
        assert row is not None
        config = _read_config(out_dir)
        output = get_or_create_artifact(
            session,
            tenant=job.tenant_id,
            location=out_dir,
            files=result.files,
            architecture=config.get("model_type"),
            num_layers=config.get("num_hidden_layers"),
        )
        link(session, row, _input_links(session, job, manifest, settings), output)
        row.status, row.finished_at, row.stage = jobs.SUCCEEDED, utcnow(), None
        row.output_artifact_id, row.plan_digest = output.id, result.plan_digest
        row.plan_summary = manifest["layers"]
        row.result = {
            "warnings": manifest["warnings"],
            "seconds": round(result.seconds, 3),
            "resolved_weights": manifest["resolved_weights"],
        }
        jobs.add_event(session, job.id, jobs.SUCCEEDED, artifact_id=output.id)


def _input_links(
    session: Any, job: Job, manifest: dict[str, Any], settings: Settings
) -> list[InputLink]:
    weights = manifest["resolved_weights"]
    links = []
    for entry in manifest["inputs"]:
        path = resolve_source(entry["source"], settings, job.tenant_id)
        config = _read_config(path)
        artifact = get_or_create_artifact(
            session,
            tenant=job.tenant_id,
            location=path,
            files=entry["files"],
            architecture=config.get("model_type"),
            num_layers=config.get("num_hidden_layers"),
        )
        links.append(InputLink(artifact, entry["role"], entry["label"], _weight(entry, weights)))
    return links


def _weight(entry: dict[str, Any], weights: dict[str, Any]) -> float | None:
    """The input's own weight where the method has one (soup/TIES/task arithmetic, role soups)."""
    role, label = entry["role"], entry["label"]
    index = int(label.split("[")[1].rstrip("]")) if "[" in label else None
    table = {"model": "models", "task": "task_soup", "language": "language_soup"}.get(role)
    if table is None or index is None or table not in weights:
        return None
    return float(weights[table][index])


def _read_config(path: Path) -> dict[str, Any]:
    import json

    try:
        data = json.loads((path / "config.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remove_leftovers(out_dir: Path) -> None:
    """A previous attempt killed mid-write leaves a staging directory beside the output."""
    if out_dir.parent.is_dir():
        for stale in out_dir.parent.glob(f".{out_dir.name}.staging-*"):
            shutil.rmtree(stale, ignore_errors=True)
