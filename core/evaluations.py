"""Evaluations on the service side: checking a request at submit, creating the job (for
POST /v1/evaluations and for a merge whose request asks for one), and the views of stored
scores: per artifact, and a merge's scores beside its inputs' with a paired noise test."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import select
from sqlalchemy.orm import Session

from core import jobs
from core.db.models import Artifact, EvaluationScore, Job, LineageEdge
from core.db.session import Database
from core.errors import InvalidRequest, NotFound
from core.evaluation.compare import paired
from core.evaluation.results import outcomes, read_samples
from core.evaluation.runner import check_backend
from core.evaluation.spec import EvaluationSpec
from core.evaluation.tasks import check_tasks, require_lm_eval
from core.hub.credentials import token_for
from core.hub.errors import HubError
from core.hub.pin import pin
from core.hub.refs import is_hub_source, parse_hub_source
from core.settings import Settings
from core.sources import resolve_source


class EvaluationCreate(BaseModel):
    """Evaluate one model: an artifact by id, a local source under the allowed roots, or a Hub
    model `hf://org/name[@revision]` (pinned to its commit at submit)."""

    model_config = ConfigDict(extra="forbid")

    artifact_id: str | None = Field(None, min_length=1, max_length=64)
    source: str | None = Field(None, min_length=1, max_length=4096)
    credential: str | None = Field(
        None, min_length=1, max_length=100, description="Hub credential name for an hf:// source"
    )
    evaluation: EvaluationSpec

    @model_validator(mode="after")
    def _one_target(self) -> EvaluationCreate:
        if (self.artifact_id is None) == (self.source is None):
            raise ValueError("give artifact_id or source, exactly one")
        return self


def check_spec(spec: EvaluationSpec, settings: Settings, *, field: str = "evaluation") -> None:
    """What a worker would refuse, refused now (422/501 naming the field): lm-eval missing
    where this process runs the evaluations (the local executor; celery workers have it, the
    API's image does not), a backend no worker offers, an unknown task."""
    if settings.executor == "local":
        require_lm_eval()
    check_backend(spec.backend, list(settings.eval_backends))
    check_tasks(list(spec.tasks), settings.eval_tasks_dir, field=f"{field}.tasks")


@dataclass(frozen=True)
class EvaluationTarget:
    target: dict[str, str]  # what the job reads: artifact_id, or source (+ credential)
    sources: list[dict[str, str]] | None = None  # a Hub source's pin, as merges record it


def target_of(
    body: EvaluationCreate, db: Database, settings: Settings, tenant: str
) -> EvaluationTarget:
    if body.artifact_id is not None:
        artifact = _artifact(db, tenant, body.artifact_id)
        if artifact.kind != "checkpoint":
            raise InvalidRequest(
                f"artifact_id: artifact {artifact.id} is an {artifact.kind}, not a model",
                details={"field": "artifact_id"},
            )
        return EvaluationTarget({"artifact_id": artifact.id})
    assert body.source is not None
    if is_hub_source(body.source):
        return _hub_target(body.source, body.credential, settings, tenant)
    if body.credential is not None:
        raise InvalidRequest(
            "credential: only an hf:// source needs one", details={"field": "credential"}
        )
    resolve_source(body.source, settings, tenant, field="source")
    return EvaluationTarget({"source": body.source})


def _hub_target(
    source: str, credential: str | None, settings: Settings, tenant: str
) -> EvaluationTarget:
    """Pinned now, like a merge's Hub sources: the job reads that commit whatever the branch
    does later. Unknown repos, revisions and credentials are refused here."""
    try:
        ref = parse_hub_source(source)
    except ValueError as e:
        raise InvalidRequest(f"source: {e}", details={"field": "source"}) from None
    token = token_for(credential, tenant=tenant, credentials=settings.hub_credentials)
    try:
        pinned = pin(ref, token)
    except HubError as e:
        e.details.setdefault("field", "source")
        raise
    target = {"source": pinned.source}
    if credential is not None:
        target["credential"] = credential
    asked = {"field": "source", "source": source, "repo": pinned.repo,
             "revision": pinned.revision, "sha": pinned.sha}  # fmt: skip
    return EvaluationTarget(target, [asked])


def _artifact(db: Database, tenant: str, artifact_id: str) -> Artifact:
    with db.session() as session:
        artifact = session.get(Artifact, artifact_id) if jobs.is_id(artifact_id) else None
        if artifact is None or artifact.tenant_id != tenant:
            raise NotFound(f"no such artifact: {artifact_id}")
        if artifact.deleted_at is not None:
            raise InvalidRequest(
                f"artifact_id: artifact {artifact_id} was deleted", details={"field": "artifact_id"}
            )
        session.expunge(artifact)
        return artifact


def evaluation_request(
    target: dict[str, Any], spec: EvaluationSpec, merge_job_id: str | None = None
) -> dict[str, Any]:
    request: dict[str, Any] = {"target": target, "evaluation": spec.model_dump()}
    if merge_job_id:
        request["merge_job_id"] = merge_job_id
    return request


def link_target(db: Database, job: Job) -> None:
    """An evaluation of an artifact is linked to it at once, so it is listed under the
    artifact while still queued (a source's artifact is known once the job has hashed it)."""
    artifact_id = job.request["target"].get("artifact_id")
    if artifact_id:
        with db.session() as session:
            session.add(evaluated_edge(job.id, artifact_id))


def evaluated_edge(job_id: str, artifact_id: str) -> LineageEdge:
    """An evaluation's place in lineage: the model it measures, as its input."""
    return LineageEdge(
        job_id=job_id, artifact_id=artifact_id, direction="input", role="evaluated", label="model"
    )


def follow_up_evaluation(
    session: Session, settings: Settings, merge: Job, artifact_id: str
) -> Job | None:
    """The evaluation a merge's request asks for, queued in the merge's final transaction; the
    reconciler dispatches it (it is in the database, so it cannot be lost)."""
    asked = merge.request.get("evaluation")
    if not asked:
        return None
    request = evaluation_request(
        {"artifact_id": artifact_id}, EvaluationSpec.model_validate(asked), merge.id
    )
    if "sweep" in merge.request:  # a sweep's trial: its evaluation belongs to the sweep too
        request["sweep"] = merge.request["sweep"]
    job = jobs.add_queued(
        session, settings, tenant=merge.tenant_id, kind="evaluation", request=request,
        sweep_id=merge.sweep_id, merge_job_id=merge.id,
    )  # fmt: skip
    session.add(evaluated_edge(job.id, artifact_id))
    return job


def score_dict(score: EvaluationScore) -> dict[str, Any]:
    return {
        "task": score.task,
        "filter": score.filter,
        "metric": score.metric,
        "value": score.value,
        "stderr": score.stderr,
        "num_fewshot": score.num_fewshot,
        "samples": score.samples,
        "task_version": score.task_version,
        "config_hash": score.config_hash,
        "lm_eval_version": score.lm_eval_version,
        "backend": score.backend,
        "settings": score.settings,
        "job_id": score.job_id,
        "duration_s": score.duration_s,
    }


def scores_of_artifact(db: Database, tenant: str, artifact_id: str) -> list[EvaluationScore]:
    """The newest score of each (task, filter, metric, settings) measured on the artifact."""
    with db.session() as session:
        rows = list(
            session.scalars(
                select(EvaluationScore)
                .where(
                    EvaluationScore.tenant_id == tenant, EvaluationScore.artifact_id == artifact_id
                )
                .order_by(EvaluationScore.id)
            )
        )
        for row in rows:
            session.expunge(row)
    newest: dict[tuple[Any, ...], EvaluationScore] = {}
    for row in rows:
        newest[_comparable(row)] = row
    return list(newest.values())


def scores_of_job(db: Database, job: Job) -> list[dict[str, Any]]:
    """An evaluation's scores: those it measured and those it reused."""
    result = job.result or {}
    artifact_id = result.get("artifact_id")
    if not artifact_id:
        return []
    spec = EvaluationSpec.model_validate(job.request["evaluation"])
    wanted = set(spec.tasks)
    return [
        score_dict(s)
        for s in scores_of_artifact(db, job.tenant_id, artifact_id)
        if s.task in wanted and s.settings == spec.settings_key() and s.backend == spec.backend
    ]


def _comparable(score: EvaluationScore) -> tuple[Any, ...]:
    settings = json.dumps(score.settings, sort_keys=True)
    return (score.task, score.filter, score.metric, settings, score.backend, score.lm_eval_version)


def comparison(db: Database, settings: Settings, merge: Job) -> list[dict[str, Any]]:
    """Each score of the merge's output beside the same score of each of its inputs, with the
    difference and a paired (McNemar) test on the documents both were scored on."""
    if merge.output_artifact_id is None:
        return []
    with db.session() as session:
        inputs = list(
            session.execute(
                select(LineageEdge.artifact_id, LineageEdge.role, LineageEdge.label).where(
                    LineageEdge.job_id == merge.id, LineageEdge.direction == "input"
                )
            ).all()
        )
    ours = scores_of_artifact(db, merge.tenant_id, merge.output_artifact_id)
    theirs = {
        artifact_id: {
            _comparable(s): s for s in scores_of_artifact(db, merge.tenant_id, artifact_id)
        }
        for artifact_id, _, _ in inputs
    }
    rows = []
    for score in ours:
        row: dict[str, Any] = {**score_dict(score), "inputs": []}
        mine = _outcomes(settings, score)
        for artifact_id, role, label in inputs:
            other = theirs[artifact_id].get(_comparable(score))
            if other is not None:
                entry = {"artifact_id": artifact_id, "role": role, "label": label}
                row["inputs"].append({**entry, **_beside(settings, score, mine, other)})
        rows.append(row)
    return rows


def _beside(
    settings: Settings, score: EvaluationScore, mine: dict[Any, bool] | None, other: EvaluationScore
) -> dict[str, Any]:
    """An input's score beside the merge's: the difference, and the paired test where both
    have right/wrong per document by the score's metric."""
    theirs = _outcomes(settings, other)
    test = paired(mine, theirs) if mine and theirs else None
    if mine is None or theirs is None:
        verdict = f"no paired test: the per-sample records say no right/wrong by {score.metric}"
    else:
        verdict = _verdict(test)
    return {
        "value": other.value,
        "stderr": other.stderr,
        "difference": score.value - other.value,
        "paired_test": test.to_dict() if test else None,
        "verdict": verdict,
    }


def _verdict(test: Any) -> str:
    if test is None:
        return "no per-sample records to compare"
    if not test.significant:
        return f"within noise (McNemar p = {test.p_value:.3g} on {test.documents} documents)"
    better = "better" if test.difference > 0 else "worse"
    return f"{better} beyond noise (McNemar p = {test.p_value:.3g} on {test.documents} documents)"


def _outcomes(settings: Settings, score: EvaluationScore) -> dict[Any, bool] | None:
    """doc id -> right or wrong by the score's own metric, from the per-sample records of the
    job that measured it: {} without records, None where the metric is not 0/1 per document."""
    path = settings.evaluations_dir / score.tenant_id / score.job_id / "samples.jsonl"
    if not path.is_file():
        return {}
    return outcomes(read_samples(path), task=score.task, filter=score.filter, metric=score.metric)


def samples_file(settings: Settings, job: Job) -> Path:
    return settings.evaluations_dir / job.tenant_id / job.id / "samples.jsonl"
