"""Evaluation as a job: resolve the model, answer what an equal earlier run already measured,
run lm-eval on the rest (stage `evaluating`, progress in requests), store the scores and the
per-sample records, and put the results in the model's card."""

from __future__ import annotations

import hashlib
import json
import logging
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from core import jobs
from core.db.models import Artifact, EvaluationScore, Job, LineageEdge, utcnow
from core.db.session import Database
from core.errors import NotFound, ServiceError
from core.evaluation.card import push_card, write_model_index
from core.evaluation.results import Score, write_samples
from core.evaluation.runner import evaluate
from core.evaluation.spec import EvaluationSpec
from core.evaluation.tasks import SHIPPED_TASKS, lm_eval_version
from core.evaluations import evaluated_edge
from core.hub.credentials import token_for
from core.hub.fetch import fetch_model
from core.hub.refs import is_hub_source
from core.integrations.mlflow_registry import add_scores
from core.lineage import get_or_create_artifact
from core.settings import Settings
from core.sources import file_guard, resolve_source
from engine.architectures import configured_layer_count
from engine.errors import EngineError
from engine.io.digests import content_digest, file_sha256
from engine.methods.layer_swap import LayerSwapRecipe
from worker.inputs import fetch_hub_inputs, local_resolver
from worker.lease import JobLease, settle_succeeded, write_with_retry

log = logging.getLogger("layerswap.evaluation")

# What decides a model's behaviour: the same bytes here, the same scores.
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
)


def model_digest(files: dict[str, str]) -> str:
    return content_digest(
        {n: sha for n, sha in files.items() if n.endswith(".safetensors") or n in MODEL_FILES}
    )


def samples_path(settings: Settings, job: Job) -> Path:
    return settings.evaluations_dir / job.tenant_id / job.id / "samples.jsonl"


def reuse_key(model: str, task: str, spec: EvaluationSpec, lm_eval: str, tasks: str) -> str:
    key = {
        "model": model,
        "task": task,
        "settings": spec.settings_key(),
        "lm_eval": lm_eval,
        "task_files": tasks,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()


def task_files_digest(tasks_dir: Path | None) -> str:
    """Our task YAMLs and loaders: editing one invalidates the results it gave."""
    digest = hashlib.sha256()
    for root in (SHIPPED_TASKS, tasks_dir):
        if root is None or not root.is_dir():
            continue
        for path in sorted(
            p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
        ):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class Target:
    artifact_id: str
    location: Path | None  # None: assembled in memory (`prebuilt`)
    digest: str  # model_digest, or the in-memory model's digest
    prebuilt: Any = None  # in_memory.Assembled


def run_evaluation(job: Job, db: Database, settings: Settings, lease: JobLease) -> None:
    spec = EvaluationSpec.model_validate(job.request["evaluation"])
    with ExitStack() as stack:
        target = _target(job, db, settings, lease, stack)
        _evaluate_target(job, db, settings, lease, spec, target)


def _evaluate_target(
    job: Job, db: Database, settings: Settings, lease: JobLease, spec: EvaluationSpec,
    target: Target,
) -> None:  # fmt: skip
    """Run the tasks no stored score answers, update the model's card and MLflow versions,
    then record the scores and the job's result in one transaction."""
    version = lm_eval_version()
    task_files = task_files_digest(settings.eval_tasks_dir)
    keys = {t: reuse_key(target.digest, t, spec, version, task_files) for t in spec.tasks}
    reused = _stored_scores(db, job.tenant_id, keys)
    run = _run_tasks(job, settings, lease, spec, target, [t for t in spec.tasks if t not in reused])
    # The point of no return: from here the scores go to the card, the Hub and MLflow, and a
    # cancel is refused; a cancel accepted before ends the job here, having written nothing.
    lease.commit_point("recording")
    if run.tasks:
        write_samples(run.samples, samples_path(settings, job))
    card = _update_model_card(db, settings, job, target, run.scores, version)
    registry = _tag_registered_versions(db, settings, target.artifact_id, run.scores)
    result = _evaluation_result(
        target=target, spec=spec, version=version, run=run, reused=reused, card=card,
        registry=registry,
    )  # fmt: skip

    def record(session: Session) -> None:
        row = settle_succeeded(session, lease, finished_at=utcnow(), stage=None)
        session.add_all(_score_rows(job, spec, target, run, keys, version))
        _attach_reused(session, job.tenant_id, target.artifact_id, [keys[t] for t in reused])
        _link_evaluated(session, job, target.artifact_id)
        row.result = result
        jobs.add_event(session, job.id, jobs.SUCCEEDED, artifact_id=target.artifact_id)

    write_with_retry(db, lease, record, settings.db_retry_s)


@dataclass(frozen=True)
class _Run:
    """The tasks this job ran itself (none: stored scores answered them all) and their outcome."""

    tasks: list[str]
    scores: list[Score] = field(default_factory=list)
    seconds: float = 0.0
    requests_run: dict[str, int] = field(default_factory=dict)
    samples: list[dict[str, Any]] = field(default_factory=list)  # per-sample records, unwritten


def _run_tasks(
    job: Job, settings: Settings, lease: JobLease, spec: EvaluationSpec, target: Target,
    tasks: list[str],
) -> _Run:  # fmt: skip
    """Evaluate `tasks` with lm-eval (stage `evaluating`), keeping their per-sample records."""
    if not tasks:
        return _Run(tasks)
    progress = lease.stage_progress("evaluating")
    outcome = evaluate(
        target.location,
        spec.model_copy(update={"tasks": tasks}),
        prebuilt=target.prebuilt,
        tasks_dir=settings.eval_tasks_dir,
        data_dir=settings.evaluation_data_dir,
        cache_prefix=settings.evaluations_dir / job.tenant_id / job.id / "cache" / "requests",
        device=settings.merge_device,
        on_progress=progress,
        should_cancel=lease.should_cancel,
        timeout_s=settings.eval_timeout_s,
    )
    return _Run(tasks, outcome.scores, outcome.seconds, outcome.requests_run, outcome.samples)


def _score_rows(
    job: Job, spec: EvaluationSpec, target: Target, run: _Run, keys: dict[str, str], version: str
) -> list[EvaluationScore]:
    """This job's scores as rows, each under its task's reuse key."""
    return [
        EvaluationScore(
            job_id=job.id,
            tenant_id=job.tenant_id,
            artifact_id=target.artifact_id,
            reuse_key=keys[score.task],
            lm_eval_version=version,
            backend=spec.backend,
            settings=spec.settings_key(),
            duration_s=run.seconds,
            **score.to_dict(),
        )
        for score in run.scores
    ]


def _evaluation_result(
    *,
    target: Target,
    spec: EvaluationSpec,
    version: str,
    run: _Run,
    reused: dict[str, str],
    card: dict[str, Any],
    registry: list[dict[str, Any]],
) -> dict[str, Any]:
    """The job's `result`: what ran, what stored scores answered, where the scores went."""
    return {
        "artifact_id": target.artifact_id,
        "lm_eval_version": version,
        "backend": spec.backend,
        "seconds": round(run.seconds, 3),
        "ran": run.tasks,
        "reused": [{"task": t, "job_id": reused[t]} for t in spec.tasks if t in reused],
        "samples": bool(run.tasks),
        # Requests this job's model answered; fewer than the tasks hold when an earlier
        # attempt's request cache answered the rest.
        "requests_run": run.requests_run,
        "card": card,
        **({"mlflow": registry} if registry else {}),
    }


def _tag_registered_versions(
    db: Database, settings: Settings, artifact_id: str, scores: list[Any]
) -> list[dict[str, Any]]:
    """Scores as tags of the MLflow versions of the merges that made this artifact. Best effort:
    a registry that is down leaves the evaluation succeeded (`tagged: false`, logged)."""
    if not scores or not settings.mlflow_tracking_uri:
        return []
    with db.session() as session:
        merges = session.execute(
            select(Job.id, Job.result).where(
                Job.output_artifact_id == artifact_id, Job.kind == "merge"
            )
        ).all()
    done = []
    for merge_id, result in merges:
        registered = (result or {}).get("mlflow")
        if not registered:
            continue
        try:
            add_scores(settings, registered, merge_id, scores)
            tagged = True
        except ServiceError as e:
            log.warning("evaluation scores not added to MLflow: %s", e.message)
            tagged = False
        done.append({**registered, "merge_job_id": merge_id, "tagged": tagged})
    return done


def _target(
    job: Job, db: Database, settings: Settings, lease: JobLease, stack: ExitStack
) -> Target:
    """The artifact evaluated: named by id, a local source (hashed now, recorded as an input
    artifact) or a Hub model (downloaded whole into the Hub cache; `stack` removes the job's
    view of it when the evaluation is over)."""
    wanted = job.request["target"]
    if is_hub_source(wanted.get("source", "")):
        return _hub_target(job, db, settings, lease, stack)
    if "layer_swap" in wanted:
        return _in_memory_target(job, db, settings, lease, stack)
    if "artifact_id" in wanted:
        with db.session() as session:
            artifact = session.get(Artifact, wanted["artifact_id"])
            if artifact is None or artifact.tenant_id != job.tenant_id:
                raise NotFound(f"artifact {wanted['artifact_id']} not found")
            if artifact.deleted_at is not None:
                raise NotFound(f"artifact {artifact.id} was deleted: nothing to evaluate")
            return Target(artifact.id, Path(artifact.location), model_digest(artifact.files))
    location = resolve_source(wanted["source"], settings, job.tenant_id, field="source")
    lease.set_stage("hashing")
    files = {
        p.name: file_sha256(p, settings.cache_dir / "sha256", lease.should_cancel)
        for p in sorted(location.iterdir())
        if p.is_file() and (p.name.endswith(".safetensors") or p.name in MODEL_FILES)
    }
    artifact_id = _artifact_for(db, job.tenant_id, str(location), files, location)
    return Target(artifact_id, location, model_digest(files))


def _artifact_for(
    db: Database, tenant: str, location: str, files: dict[str, str], directory: Path
) -> str:
    """The artifact recorded for this model at `location`, or a new one."""
    with db.session() as session:
        # A merge records an input by its weights and config only: the same model, if every
        # file it recorded has the bytes this one has.
        for known in session.scalars(
            select(Artifact)
            .where(Artifact.tenant_id == tenant, Artifact.location == location)
            .where(Artifact.deleted_at.is_(None), Artifact.kind == "checkpoint")
            .order_by(Artifact.created_at.desc())
        ):
            if known.files and all(files.get(n) == sha for n, sha in known.files.items()):
                return known.id
        config = _read_json(directory / "config.json")
        artifact = get_or_create_artifact(
            session,
            tenant=tenant,
            location=location,
            files=files,
            architecture=config.get("model_type"),
            num_layers=configured_layer_count(config),
        )
        return artifact.id


def _hub_target(
    job: Job, db: Database, settings: Settings, lease: JobLease, stack: ExitStack
) -> Target:
    source = job.request["target"]["source"]  # pinned to a commit sha at submit
    token = token_for(
        job.request["target"].get("credential"),
        tenant=job.tenant_id,
        credentials=settings.hub_credentials,
    )
    fetched = fetch_model(
        source,
        cache_dir=settings.cache_dir / "hub",
        token=token,
        on_progress=lease.stage_progress("downloading"),
        should_cancel=lease.should_cancel,
    )
    stack.callback(fetched.close)
    view = fetched.directories[source]
    # LFS files: the Hub's sha256; small files hashed here (as merges record Hub inputs).
    files = {
        p.name: fetched.digests.get(p) or file_sha256(p.resolve(), settings.cache_dir / "sha256")
        for p in sorted(view.iterdir())
        if p.name.endswith(".safetensors") or p.name in MODEL_FILES
    }
    return Target(_artifact_for(db, job.tenant_id, source, files, view), view, model_digest(files))


def _in_memory_target(
    job: Job, db: Database, settings: Settings, lease: JobLease, stack: ExitStack
) -> Target:
    """A layer swap evaluated without writing it (sweeps): assembled from the experts in
    memory (Hub experts fetched as a merge fetches them: the shards the plan reads), recorded
    as an `in_memory` artifact named by the model's digest."""
    from core.evaluation.in_memory import assemble  # imports torch and transformers

    recipe = LayerSwapRecipe.model_validate(job.request["target"]["layer_swap"])
    resolve = local_resolver(job, settings)
    known: dict[Path, str] = {}
    fetched = fetch_hub_inputs(job, recipe, settings, lease)
    if fetched is not None:
        stack.callback(fetched.close)
        resolve, known = fetched.resolver(resolve), fetched.digests
    lease.set_stage("assembling")
    built = assemble(
        recipe,
        resolve=resolve,
        hash_cache=settings.cache_dir / "sha256",
        known_digests=known,
        should_cancel=lease.should_cancel,
        guard=file_guard(settings, job.tenant_id),
    )
    config = built.model.config
    with db.session() as session:
        artifact = get_or_create_artifact(
            session,
            tenant=job.tenant_id,
            location=f"memory://{built.digest}",
            files={},
            kind="in_memory",
            architecture=getattr(config, "model_type", None),
            num_layers=configured_layer_count(config.to_dict()),
        )
        return Target(artifact.id, None, built.digest, built)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _stored_scores(db: Database, tenant: str, keys: dict[str, str]) -> dict[str, str]:
    """Task -> id of the job whose stored scores answer it."""
    found: dict[str, str] = {}
    with db.session() as session:
        for task, key in keys.items():
            job_id = session.scalar(
                select(EvaluationScore.job_id)
                .where(EvaluationScore.tenant_id == tenant, EvaluationScore.reuse_key == key)
                .order_by(EvaluationScore.created_at)
                .limit(1)
            )
            if job_id is not None:
                found[task] = job_id
    return found


def _attach_reused(session: Session, tenant: str, artifact_id: str, keys: list[str]) -> None:
    """Scores answered from another artifact with the same content (an identical merge made
    again, say) are recorded for this artifact too, still naming the job that measured them
    (whose per-sample records they come from)."""
    for key in keys:
        have = session.scalar(
            select(EvaluationScore.id).where(
                EvaluationScore.artifact_id == artifact_id, EvaluationScore.reuse_key == key
            )
        )
        if have is not None:
            continue
        first = session.scalar(
            select(EvaluationScore.job_id)
            .where(EvaluationScore.tenant_id == tenant, EvaluationScore.reuse_key == key)
            .order_by(EvaluationScore.created_at)
            .limit(1)
        )
        for score in session.scalars(
            select(EvaluationScore).where(
                EvaluationScore.reuse_key == key, EvaluationScore.job_id == first
            )
        ).all():
            copied = {c.name: getattr(score, c.name) for c in EvaluationScore.__table__.columns}
            copied.pop("id")
            session.add(EvaluationScore(**{**copied, "artifact_id": artifact_id}))


def _link_evaluated(session: Session, job: Job, artifact_id: str) -> None:
    exists = session.scalar(
        select(LineageEdge.id).where(
            LineageEdge.job_id == job.id, LineageEdge.artifact_id == artifact_id
        )
    )
    if exists is None:
        session.add(evaluated_edge(job.id, artifact_id))


# What updating a card can meet: the database, the files, a card's front matter that is not
# YAML, the Hub (HubError; an unknown credential too) or a recipe it cannot read (RecipeError).
_CARD_ERRORS = (SQLAlchemyError, OSError, ValueError, yaml.YAMLError, EngineError)


def _update_model_card(
    db: Database, settings: Settings, job: Job, target: Target, scores: list[Score], version: str
) -> dict[str, Any]:
    """Before the job is recorded: the card of an output of ours gets a model-index with every
    score known for the model, and so does its Hub copy (one commit; a retry finds the branch
    already holding that card and commits nothing). A failure here is reported in the result,
    not the job's: the scores are what matter, the card is a view of them."""
    if target.location is None:
        return {"updated": False}  # assembled in memory: no card to update
    pending = [{**s.to_dict(), "lm_eval_version": version} for s in scores]
    try:
        written = write_model_index(db, settings, target.artifact_id, target.location, pending)
        commits = push_card(db, settings, target.artifact_id, target.location)
    except _CARD_ERRORS as e:
        log.warning("job %s: model card not updated (%s)", job.id, e)
        return {"updated": False, "error": str(e)}
    return {"updated": written, "hub_commits": commits}
