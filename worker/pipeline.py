"""run_job: the one function that executes a job, whichever executor delivered it.

claim (compare-and-set) -> plan -> merge, writing progress at a bounded rate -> record the
output artifact and its lineage -> succeeded | failed | canceled.
"""

from __future__ import annotations

import json
import logging
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from core import jobs
from core.db.models import Artifact, Job, utcnow
from core.db.session import Database
from core.errors import API_ADVICE, ServiceError
from core.evaluations import follow_up_evaluation
from core.hub import timeouts as hub_timeouts
from core.hub.credentials import token_for
from core.hub.errors import HubError
from core.hub.publish import publish
from core.hub.refs import is_hub_source
from core.integrations import mlflow_registry, openlineage
from core.kinds import merge_recipe
from core.lineage import InputLink, get_or_create_artifact, link, stored_size
from core.quota import space_reserver
from core.settings import Settings
from core.sources import file_guard
from core.webhooks.outbox import artifact_published
from engine.architectures import configured_layer_count
from engine.errors import (
    DiskFull,
    EngineError,
    MergeCanceled,
    OutputError,
    is_disk_full,
)
from engine.io.digests import content_digest
from engine.io.lora import split_source
from engine.merge import MergeOptions, merge
from engine.mergekit import MergekitOrigin
from worker.analysis_jobs import run_analysis_job
from worker.evaluation_jobs import run_evaluation
from worker.inputs import fetch_hub_inputs, local_resolver
from worker.lease import (
    JobLease,
    LeaseLost,
    brief,
    settle,
    settle_succeeded,
    write_with_retry,
)
from worker.outputs import (
    discard_output,
    identical_output,
    made_by,
    published_by_earlier_attempt,
    remove_leftovers,
)
from worker.stopping import hand_back

log = logging.getLogger("layerswap.pipeline")


def run_job(
    job_id: str, *, db: Database, settings: Settings, stopping: threading.Event | None = None
) -> bool:
    """Execute one job if this delivery wins the claim; never raises for job failures.

    A delivery for a job that is running elsewhere, finished or canceled does nothing, so a
    broker may deliver twice and the reconciler may re-dispatch freely. Once `stopping` is set
    (the process is stopping) the attempt stops and hands its job back to the queue
    (worker/stopping.py); returns whether it did, so the caller can send the job again."""
    hub_timeouts.configure(settings.hub_timeout_s, settings.hub_min_bytes_per_s)
    attempt = jobs.claim(db, job_id)
    if attempt is None:
        log.info("job %s: not queued (running elsewhere or finished); delivery ignored", job_id)
        return False
    with db.session() as session:
        job = session.get(Job, job_id)
        assert job is not None
    log.info("job %s: attempt %d started", job_id, attempt)
    with JobLease(db, job_id, attempt, settings, stopping) as lease:
        # Only once the lease beats, and only queued here (sent by a thread of its own): a
        # lineage backend that is slow or stuck neither delays a job nor makes it look dead.
        openlineage.job_started(db, settings, job_id, attempt)
        handed_back = _attempt(job, db, settings, lease)
    openlineage.job_ended(db, settings, job_id)
    log.info("job %s: attempt %d done", job_id, attempt)
    return handed_back


def _attempt(job: Job, db: Database, settings: Settings, lease: JobLease) -> bool:
    """Run the claimed job to its end, whatever it raises; whether it was handed back."""
    try:
        _runner(job.kind)(job, db, settings, lease)
    except LeaseLost:
        log.warning(
            "job %s: attempt %d was superseded; its result is dropped", job.id, lease.attempt
        )
    except MergeCanceled:
        return _stopped(db, lease, settings)
    except (EngineError, ServiceError) as e:
        _finish(db, lease, jobs.FAILED, settings, error=_error_dict(e))
    except Exception as e:  # the job's boundary: it fails the job, not the worker
        _finish(db, lease, jobs.FAILED, settings, error=_unexpected(job.id, e))
    return False


def _stopped(db: Database, lease: JobLease, settings: Settings) -> bool:
    """An attempt that stopped at a cancel check: lease lost (nothing to write), canceled, or
    its process stopping, when the job goes back to the queue (True) unless it was canceled
    meanwhile."""
    if lease.lost:
        log.warning("job %s: attempt %d stopped: lease lost", lease.job_id, lease.attempt)
        return False
    if lease.stopping and not lease.cancel:
        try:
            if hand_back(db, lease):
                return True
        except SQLAlchemyError as e:
            log.warning(
                "job %s: not handed back (%s); re-queued once its heartbeat is stale",
                lease.job_id,
                brief(e),
            )
            return False
    _finish(db, lease, jobs.CANCELED, settings)
    return False


def _runner(kind: str) -> Callable[[Job, Database, Settings, JobLease], None]:
    """What runs a job of this kind (core/kinds.py: what else a kind is)."""
    runners = {"merge": run_merge, "analysis": run_analysis_job, "evaluation": run_evaluation}
    return runners[kind]


def _unexpected(job_id: str, error: Exception) -> dict[str, Any]:
    """The error of a job that raised what no step expected; called while handling it."""
    full = _disk_full(error)
    if full is not None:  # outside the engine: analysis files, removing, adopting outputs
        log.warning("job %s: %s", job_id, full.message)
        return _error_dict(full)
    log.exception("job %s failed unexpectedly", job_id)
    return {"code": "internal_error", "message": "unexpected error; see the worker log"}


def _disk_full(error: BaseException) -> DiskFull | None:
    """DiskFull for an ENOSPC/EDQUOT anywhere in the exception's chain (None otherwise): the
    job fails with `disk_full`, which says what to do (free space), not `internal_error`."""
    seen: BaseException | None = error
    while seen is not None:
        if is_disk_full(seen):
            path = getattr(seen, "filename", None) or "the data directory"
            return DiskFull.at(path, "the job's files")
        seen = seen.__cause__ or seen.__context__
    return None


def _error_dict(error: EngineError | ServiceError) -> dict[str, Any]:
    """The job's error as the API shows it: an engine error's remedy in the API's words."""
    message = error.advised(API_ADVICE) if isinstance(error, EngineError) else error.message
    return {"code": error.code, "message": message, "details": error.details}


def _finish(db: Database, lease: JobLease, status: str, settings: Settings, **values: Any) -> None:
    def write(session: Session) -> None:
        settle(session, lease, status=status, finished_at=utcnow(), stage=None, **values)
        jobs.add_event(session, lease.job_id, status, **(values.get("error") or {}))

    try:
        write_with_retry(db, lease, write, settings.db_retry_s)
    except LeaseLost:
        log.warning(
            "job %s: attempt %d was superseded; not marked %s", lease.job_id, lease.attempt, status
        )


def run_merge(job: Job, db: Database, settings: Settings, lease: JobLease) -> None:
    """Make a merge job's output, publish and register it where the recipe asks, record it.

    An output this job published in an earlier attempt, or (a sweep's trial) one that another
    job already made from the same configuration, is used instead of merging again."""
    recipe = merge_recipe(job.request)
    out_dir = jobs.output_dir(settings, job)
    remove_leftovers(out_dir, job.id, lease.attempt)
    fetched = None
    try:
        result = published_by_earlier_attempt(out_dir, job.id)
        reused_from = None
        if result is None and "sweep" in job.request:  # a sweep's configuration tried before
            found = _made_by_another_job(job, recipe, db, settings, lease)
            if found is not None:
                reused_from, result = found
                out_dir = result.out_dir
        if result is None:
            fetched = fetch_hub_inputs(job, recipe, settings, lease)
            result = _merge(job, recipe, out_dir, settings, lease, fetched, db)
        elif reused_from is None:
            log.info("job %s: adopting the output an earlier attempt published", job.id)
        own = out_dir if reused_from is None else None
        with _discarded_if_canceled(own, job.id):
            published = _publish(job, recipe, out_dir, result, settings, lease)
            registered = _register_output(
                job, recipe, result, published, settings, lease, discard=own
            )
            made = _MergeOutput(out_dir, result, reused_from, published, registered)
            inputs = fetched.directories if fetched else {}
            write_with_retry(
                db, lease,
                lambda session: _record_success(session, job, lease, settings, made, inputs),
                settings.db_retry_s,
            )  # fmt: skip
    finally:
        if fetched is not None:
            fetched.close()


@contextmanager
def _discarded_if_canceled(own: Path | None, job_id: str) -> Iterator[None]:
    """A cancel accepted before the point of no return (the Hub commit, the MLflow version,
    or, with neither, the success itself) takes the output this job made with it; one reused
    from another job stays that job's."""
    try:
        yield
    except MergeCanceled:
        if own is not None:
            discard_output(own, job_id)
        raise


@dataclass(frozen=True)
class _MergeOutput:
    """What a merge job made (or reused) and where it sent it: the values its record holds."""

    out_dir: Path
    result: Any  # MergeResult
    reused_from: str | None
    published: dict[str, Any] | None
    registered: dict[str, Any] | None


def _made_by_another_job(
    job: Job, recipe: Any, db: Database, settings: Settings, lease: JobLease
) -> tuple[str, Any] | None:
    """(job id, MergeResult) of an earlier job's identical output, found in the `planning`
    stage (the search plans the recipe and hashes its inputs)."""
    lease.set_stage("planning")
    found = identical_output(job, recipe, db, settings, lease.should_cancel)
    if found is not None:
        log.info("job %s: %s already made this merge; reused", job.id, found[0])
    return found


def _publish(
    job: Job, recipe: Any, out_dir: Path, result: Any, settings: Settings, lease: JobLease
) -> dict[str, Any] | None:
    """The Hub commit the output was published as (None: the recipe asks for none)."""
    if recipe.output.hub is None:
        return None
    lease.set_stage("publishing")
    token = token_for(
        recipe.output.hub.credential, tenant=job.tenant_id,
        credentials=settings.hub_credentials, field="output.hub.credential",
    )  # fmt: skip
    try:
        return publish(
            out_dir, recipe.output.hub, token=token, job_id=job.id, digests=result.files,
            before_commit=lambda: lease.commit_point("committing"),
        ).to_dict()  # fmt: skip
    except HubError:
        # The job failed: it leaves no output, and the same name can be asked again.
        shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _register_output(
    job: Job,
    recipe: Any,
    result: Any,
    published: dict[str, Any] | None,
    settings: Settings,
    lease: JobLease,
    *,
    discard: Path | None,
) -> dict[str, Any] | None:
    """The MLflow model version the output was registered as (None: the recipe asks for
    none). If registering fails, `discard` (this job's own output, not a reused one) is
    removed, as for publishing: the job leaves no output and the name is free."""
    if recipe.output.mlflow is None:
        return None
    lease.commit_point("registering")
    try:
        return _register(job, recipe, result, published, settings)
    except ServiceError:
        if discard is not None:
            shutil.rmtree(discard, ignore_errors=True)
        raise


def _record_success(
    session: Session,
    job: Job,
    lease: JobLease,
    settings: Settings,
    made: _MergeOutput,
    inputs: dict[str, Path],
) -> None:
    """Settle the job as succeeded with its output artifact, lineage, result and follow-ups."""
    row = settle_succeeded(session, lease, finished_at=utcnow(), stage=None)
    manifest = made.result.manifest
    output = _output_artifact(session, job, made)
    link(session, row, _input_links(session, job, manifest, settings, inputs), output)
    row.output_artifact_id, row.plan_digest = output.id, made.result.plan_digest
    row.plan_summary = manifest["layers"]
    row.result = _result_summary(made)
    if made.published:
        artifact_published(session, row, output.id, made.published)
    evaluation = follow_up_evaluation(session, settings, row, output.id)
    if evaluation is not None:
        row.result = {**row.result, "evaluation_job_id": evaluation.id}
    jobs.add_event(session, job.id, jobs.SUCCEEDED, artifact_id=output.id)


def _output_artifact(session: Session, job: Job, made: _MergeOutput) -> Artifact:
    """The output's artifact (found or made), with this job's Hub commit added to it."""
    config = _read_config(made.out_dir)
    output = get_or_create_artifact(
        session,
        tenant=job.tenant_id,
        location=made.out_dir,
        files=made.result.files,
        architecture=config.get("model_type"),
        num_layers=configured_layer_count(config),
        size_bytes=stored_size(made.out_dir, made.result.files),
    )
    if made.published and made.published not in (output.published or []):
        output.published = [*(output.published or []), made.published]
    return output


def _result_summary(made: _MergeOutput) -> dict[str, Any]:
    """The job's `result`: the merge's warnings, time and weights, and where the output went."""
    manifest = made.result.manifest
    return {
        "warnings": manifest["warnings"],
        "seconds": round(made.result.seconds, 3),
        "resolved_weights": manifest["resolved_weights"],
        **({"published": made.published} if made.published else {}),
        **({"reused_from": made.reused_from} if made.reused_from else {}),
        **({"mlflow": made.registered} if made.registered else {}),
    }


def _register(
    job: Job, recipe: Any, result: Any, published: dict[str, Any] | None, settings: Settings
) -> dict[str, Any]:
    """The output as an MLflow model version (found, not made again, on a retry)."""
    sources = [
        {"role": i["role"], "source": i["source"], "content_digest": content_digest(i["files"])}
        for i in result.manifest["inputs"]
    ]
    return mlflow_registry.register(
        settings, tenant=job.tenant_id, job_id=job.id, request=job.request,
        destination=recipe.output.mlflow,
        files=result.files, plan_digest=result.plan_digest, sources=sources,
        published=published, artifact_hint=f"/v1/merges/{job.id}",
    )  # fmt: skip


def _merge(
    job: Job,
    recipe: Any,
    out_dir: Path,
    settings: Settings,
    lease: JobLease,
    fetched: Any,
    db: Database,
) -> Any:
    local = local_resolver(job, settings)
    options = MergeOptions(
        device=settings.merge_device,
        hash_cache=settings.cache_dir / "sha256",
        # Only this job's own earlier output is ever replaced (it failed verification).
        overwrite=made_by(out_dir, job.id),
        staging_tag=f"{job.id}-a{lease.attempt}",
        job={"id": job.id, "attempt": lease.attempt},
        known_digests=fetched.digests if fetched else {},
        reserve_space=space_reserver(db, settings, job.tenant_id),
        file_guard=file_guard(settings, job.tenant_id),
        max_output_ratio=settings.max_output_ratio,
        mergekit=MergekitOrigin.from_record(job.request["mergekit"])
        if "mergekit" in job.request
        else None,
    )
    try:
        return merge(
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
        adopted = published_by_earlier_attempt(out_dir, job.id)
        if adopted is None:
            raise
        return adopted


def _input_links(
    session: Any,
    job: Job,
    manifest: dict[str, Any],
    settings: Settings,
    hub_dirs: dict[str, Path],
) -> list[InputLink]:
    """Input artifacts: local ones by resolved path, Hub ones by `hf://repo@<commit sha>`."""
    weights = manifest["resolved_weights"]
    links = []
    for entry in manifest["inputs"]:
        # a model+adapter source: the model, then its LoRA adapter, each an input artifact
        model, adapter = split_source(entry["source"])
        parts = [(model, entry["files"], entry["label"], _weight(entry, weights))]
        if adapter is not None:
            adapter_files = entry.get("adapter_files", {})
            parts.append((adapter, adapter_files, f"{entry['label']}.adapter", None))
        for source, files, label, weight in parts:
            artifact = _input_artifact(session, job, settings, hub_dirs, source, files)
            links.append(InputLink(artifact, entry["role"], label, weight))
    return links


def _input_artifact(
    session: Any, job: Job, settings: Settings, hub_dirs: dict[str, Path], source: str,
    files: dict[str, str],
) -> Any:  # fmt: skip
    if is_hub_source(source):
        location, config = source, _read_config(hub_dirs[source]) if source in hub_dirs else {}
    else:
        path = local_resolver(job, settings)(source)
        location, config = str(path), _read_config(path)
    return get_or_create_artifact(
        session,
        tenant=job.tenant_id,
        location=location,
        files=files,
        architecture=config.get("model_type"),
        num_layers=configured_layer_count(config),
    )


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
