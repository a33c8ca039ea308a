"""run_job: the one function that executes a job, whichever executor delivered it.

claim (compare-and-set) -> plan -> merge, writing progress at a bounded rate -> record the
output artifact and its lineage -> succeeded | failed | canceled.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import update
from sqlalchemy.exc import InterfaceError, OperationalError, SQLAlchemyError
from sqlalchemy.orm import Session

from service import jobs
from service.db.models import Job, utcnow
from service.db.session import Database
from service.errors import ServiceError
from service.lineage import InputLink, get_or_create_artifact, link
from service.settings import Settings
from service.sources import resolve_source
from worker.engine.errors import EngineError, MergeCanceled, OutputError
from worker.engine.progress import Progress

log = logging.getLogger("layerswap.pipeline")
EVENT_INTERVAL_S = 2.0


class LeaseLost(Exception):
    """The job was given to another attempt (this one was presumed dead) or finished."""


class JobLease:
    """One attempt's hold on its job: heartbeats, throttled progress and the cancel flag.

    Every write is fenced by (status running|canceling, attempts == this attempt): once the
    reconciler has handed the job to another attempt, this one can change nothing, and it stops
    at its next cancel check. Heartbeats come from their own thread, so a long step with no
    progress (an fsync, a huge tensor) never makes a live job look dead. A database that is
    briefly away costs some heartbeats and progress rows, never the merge.
    """

    def __init__(self, db: Database, job_id: str, attempt: int, settings: Settings) -> None:
        self.db, self.job_id, self.attempt = db, job_id, attempt
        self.progress_interval = settings.progress_interval_s
        self.heartbeat_interval = settings.heartbeat_interval_s
        self.lost = self.cancel = False
        self._written = self._event = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{job_id[:8]}")

    def __enter__(self) -> JobLease:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def fenced(self) -> Any:
        return update(Job).where(
            Job.id == self.job_id, Job.attempts == self.attempt, Job.status.in_(jobs.ACTIVE)
        )

    def holds(self, job: Job) -> bool:
        return job.attempts == self.attempt and job.status in jobs.ACTIVE

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_interval):
            try:
                with self.db.session() as session:
                    row = session.execute(
                        self.fenced().values(heartbeat_at=utcnow()).returning(Job.cancel_requested)
                    ).first()
            except SQLAlchemyError as e:
                log.warning("job %s: heartbeat not written (%s)", self.job_id, _brief(e))
                continue
            if row is None:
                log.warning(
                    "job %s: attempt %d lost its lease; stopping", self.job_id, self.attempt
                )
                self.lost = True
                return
            self.cancel = bool(row[0])

    def should_cancel(self) -> bool:
        return self.cancel or self.lost

    def set_stage(self, stage: str) -> None:
        try:
            with self.db.session() as session:
                session.execute(self.fenced().values(stage=stage, heartbeat_at=utcnow()))
        except SQLAlchemyError as e:
            log.warning("job %s: stage not written (%s)", self.job_id, _brief(e))

    def progress(self, p: Progress) -> None:
        now = time.monotonic()
        if now - self._written < self.progress_interval and p.bytes_done < p.bytes_total:
            return
        self._written = now
        counts = {
            "stage": p.stage,
            "bytes_done": p.bytes_done,
            "bytes_total": p.bytes_total,
            "tensors_done": p.tensors_done,
            "tensors_total": p.tensors_total,
        }
        try:
            with self.db.session() as session:
                written = session.execute(self.fenced().values(heartbeat_at=utcnow(), **counts))
                if int(getattr(written, "rowcount", 0)) == 1 and (
                    now - self._event >= EVENT_INTERVAL_S or p.bytes_done >= p.bytes_total
                ):
                    self._event = now
                    jobs.add_event(session, self.job_id, "progress", **counts)
        except SQLAlchemyError as e:  # progress is best effort; the next write catches up
            log.warning("job %s: progress not written (%s)", self.job_id, _brief(e))


def run_job(job_id: str, *, db: Database, settings: Settings) -> None:
    """Execute one job if this delivery wins the claim; never raises for job failures.

    A delivery for a job that is running elsewhere, finished or canceled does nothing, so a
    broker may deliver twice and the reconciler may re-dispatch freely."""
    attempt = jobs.claim(db, job_id)
    if attempt is None:
        log.info("job %s: not queued (running elsewhere or finished); delivery ignored", job_id)
        return
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
    log.info("job %s: attempt %d started", job_id, attempt)
    with JobLease(db, job_id, attempt, settings) as lease:
        try:
            if job.kind == "merge":
                _run_merge(job, db, settings, lease)
            else:
                from worker.analysis_jobs import run_analysis

                result = run_analysis(job, settings)
                _finish(db, lease, jobs.SUCCEEDED, settings, result=result)
        except LeaseLost:
            log.warning("job %s: attempt %d was superseded; its result is dropped", job_id, attempt)
        except MergeCanceled:
            if lease.lost:
                log.warning("job %s: attempt %d stopped: lease lost", job_id, attempt)
            else:
                _finish(db, lease, jobs.CANCELED, settings)
        except (EngineError, ServiceError) as e:
            _finish(db, lease, jobs.FAILED, settings, error=_error_dict(e))
        except Exception:
            log.exception("job %s failed unexpectedly", job_id)
            error = {"code": "internal_error", "message": "unexpected error; see the worker log"}
            _finish(db, lease, jobs.FAILED, settings, error=error)
    log.info("job %s: attempt %d done", job_id, attempt)


def _error_dict(error: EngineError | ServiceError) -> dict[str, Any]:
    return {"code": error.code, "message": error.message, "details": error.details}


def _finish(db: Database, lease: JobLease, status: str, settings: Settings, **values: Any) -> None:
    def write(session: Session) -> None:
        job = _held_row(session, db, lease)
        job.status, job.finished_at, job.stage = status, utcnow(), None
        for key, value in values.items():
            setattr(job, key, value)
        jobs.add_event(session, job.id, status, **(values.get("error") or {}))

    try:
        _write_with_retry(db, lease, write, settings.db_retry_s)
    except LeaseLost:
        log.warning(
            "job %s: attempt %d was superseded; not marked %s", lease.job_id, lease.attempt, status
        )


def _held_row(session: Session, db: Database, lease: JobLease) -> Job:
    job = session.get(Job, lease.job_id, with_for_update=not db.is_sqlite)
    if job is None or not lease.holds(job):
        raise LeaseLost(lease.job_id)
    return job


def _write_with_retry(
    db: Database, lease: JobLease, write: Callable[[Session], None], budget_s: float
) -> None:
    """The final write of an attempt survives a database restart: retried with backoff for
    `budget_s`. Past that the job stays running, its heartbeat goes stale, and the reconciler
    hands it to a new attempt (which adopts the output this one published)."""
    deadline, pause = time.monotonic() + budget_s, 0.2
    while True:
        try:
            with db.session() as session:
                write(session)
            return
        except (OperationalError, InterfaceError) as e:
            if time.monotonic() + pause > deadline:
                raise
            log.warning("job %s: database unavailable (%s); retrying", lease.job_id, _brief(e))
            time.sleep(pause)
            pause = min(pause * 2, 5.0)


def _brief(error: Exception) -> str:
    return str(error).splitlines()[0][:200]


def _run_merge(job: Job, db: Database, settings: Settings, lease: JobLease) -> None:
    from worker.engine.recipe import parse_recipe
    from worker.hub.credentials import token_for
    from worker.hub.errors import HubError
    from worker.hub.publish import publish

    recipe = parse_recipe(job.request)
    out_dir = jobs.output_dir(settings, job)
    _remove_leftovers(out_dir, job.id, lease.attempt)
    fetched = None
    try:
        result = _published_by_earlier_attempt(out_dir, job.id)
        if result is None:
            result, fetched = _merge(job, recipe, out_dir, settings, lease)
        else:
            log.info("job %s: adopting the output an earlier attempt published", job.id)
        published = None
        if recipe.output.hub is not None:
            lease.set_stage("publishing")
            token = token_for(recipe.output.hub.credential, settings.hub_credentials)
            try:
                published = publish(
                    out_dir, recipe.output.hub, token=token, job_id=job.id, digests=result.files
                ).to_dict()
            except HubError:
                # The job failed: it leaves no output, and the same name can be asked again.
                shutil.rmtree(out_dir, ignore_errors=True)
                raise
        inputs = fetched.directories if fetched else {}

        def record(session: Session) -> None:
            row = _held_row(session, db, lease)
            manifest = result.manifest
            config = _read_config(out_dir)
            output = get_or_create_artifact(
                session,
                tenant=job.tenant_id,
                location=out_dir,
                files=result.files,
                architecture=config.get("model_type"),
                num_layers=config.get("num_hidden_layers"),
            )
            if published and published not in (output.published or []):
                output.published = [*(output.published or []), published]
            links = _input_links(session, job, manifest, settings, inputs)
            link(session, row, links, output)
            row.status, row.finished_at, row.stage = jobs.SUCCEEDED, utcnow(), None
            row.output_artifact_id, row.plan_digest = output.id, result.plan_digest
            row.plan_summary = manifest["layers"]
            row.result = {
                "warnings": manifest["warnings"],
                "seconds": round(result.seconds, 3),
                "resolved_weights": manifest["resolved_weights"],
                **({"published": published} if published else {}),
            }
            jobs.add_event(session, job.id, jobs.SUCCEEDED, artifact_id=output.id)

        _write_with_retry(db, lease, record, settings.db_retry_s)
    finally:
        if fetched is not None:
            fetched.close()


def _merge(
    job: Job, recipe: Any, out_dir: Path, settings: Settings, lease: JobLease
) -> tuple[Any, Any]:
    """Fetch what Hub sources the merge needs, then merge; (MergeResult, FetchedInputs|None)."""
    from worker.engine.merge import MergeOptions, merge
    from worker.hub.credentials import token_for
    from worker.hub.fetch import fetch_inputs, hub_sources

    def local(source: str) -> Path:
        return resolve_source(source, settings, job.tenant_id)

    fetched = None
    if hub_sources(recipe):
        started = time.monotonic()

        def downloaded(done: int, total: int) -> None:
            elapsed = time.monotonic() - started
            lease.progress(Progress("downloading", done, total, 0, 0, elapsed))

        fetched = fetch_inputs(
            recipe,
            cache_dir=settings.cache_dir / "hub",
            token=token_for(recipe.credential, settings.hub_credentials),
            local=local,
            on_progress=downloaded,
            should_cancel=lease.should_cancel,
        )
    options = MergeOptions(
        device=settings.merge_device,
        hash_cache=settings.cache_dir / "sha256",
        # Only this job's own earlier output is ever replaced (it failed verification).
        overwrite=_made_by(out_dir, job.id),
        staging_tag=f"{job.id}-a{lease.attempt}",
        job={"id": job.id, "attempt": lease.attempt},
        known_digests=fetched.digests if fetched else {},
    )
    try:
        result = merge(
            recipe,
            out_dir,
            resolve=fetched.resolver(local) if fetched else local,
            options=options,
            on_progress=lease.progress,
            should_cancel=lease.should_cancel,
        )
    except OutputError:
        # An attempt presumed dead (but only cut off) published this job's output while
        # this one merged: the same bytes, already in place.
        result = _published_by_earlier_attempt(out_dir, job.id)
        if result is None:
            if fetched is not None:
                fetched.close()
            raise
    except BaseException:
        if fetched is not None:
            fetched.close()
        raise
    return result, fetched


def _published_by_earlier_attempt(out_dir: Path, job_id: str) -> Any:
    """An attempt that died after publishing (before recording) left a complete output: its
    manifest names this job and every file still has the sha256 it lists. Re-merging would
    only rewrite the same bytes, so the output is adopted as it is."""
    from worker.engine.digests import file_sha256
    from worker.engine.merge import MANIFEST, MergeResult

    manifest = _read_manifest(out_dir)
    if manifest is None or manifest.get("job", {}).get("id") != job_id:
        return None
    files: dict[str, str] = dict(manifest.get("outputs", {}))
    for name, sha in files.items():
        if not (out_dir / name).is_file() or file_sha256(out_dir / name) != sha:
            return None
    files[MANIFEST] = file_sha256(out_dir / MANIFEST)
    present = {p.name for p in out_dir.iterdir()}
    if present != set(files):
        return None
    return MergeResult(out_dir, files, manifest["plan_digest"], manifest, 0.0)


def _made_by(out_dir: Path, job_id: str) -> bool:
    manifest = _read_manifest(out_dir)
    return manifest is not None and manifest.get("job", {}).get("id") == job_id


def _read_manifest(out_dir: Path) -> dict[str, Any] | None:
    from worker.engine.merge import MANIFEST

    try:
        data = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _input_links(
    session: Any,
    job: Job,
    manifest: dict[str, Any],
    settings: Settings,
    hub_dirs: dict[str, Path],
) -> list[InputLink]:
    """Input artifacts: local ones by resolved path, Hub ones by `hf://repo@<commit sha>`."""
    from worker.hub.refs import is_hub_source

    weights = manifest["resolved_weights"]
    links = []
    for entry in manifest["inputs"]:
        source = entry["source"]
        if is_hub_source(source):
            location, config = source, _read_config(hub_dirs[source]) if source in hub_dirs else {}
        else:
            path = resolve_source(source, settings, job.tenant_id)
            location, config = str(path), _read_config(path)
        artifact = get_or_create_artifact(
            session,
            tenant=job.tenant_id,
            location=location,
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
    try:
        data = json.loads((path / "config.json").read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _remove_leftovers(out_dir: Path, job_id: str, attempt: int) -> None:
    """Earlier attempts of this job, killed mid-write, leave staging (or swapped-out)
    directories beside the output. Only theirs are removed: another job's, or a live attempt's,
    are not ours to touch (earlier attempts are dead: the reconciler fenced them off)."""
    if not out_dir.parent.is_dir():
        return
    prefix = f".{out_dir.name}.staging-{job_id}-a"
    for stale in out_dir.parent.glob(f"{prefix}*-*"):
        number = stale.name.removeprefix(prefix).split("-", 1)[0]
        if number.isdigit() and int(number) < attempt:
            shutil.rmtree(stale, ignore_errors=True)
    for swapped in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        shutil.rmtree(swapped, ignore_errors=True)
