"""Scores in the model card: a `model-index` in the YAML front matter of README.md, for models
this service wrote (its outputs). The card's new sha256 is recorded in layerswap.json and in the
artifact, so the output still verifies; inputs the service only read are never modified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from sqlalchemy import select

from core.db.models import Artifact, EvaluationScore, Job, LineageEdge
from core.db.session import Database
from core.hub.credentials import token_for
from core.hub.publish import publish_card
from core.kinds import merge_recipe
from core.settings import Settings
from engine.io.digests import content_digest, file_sha256

CARD, MANIFEST = "README.md", "layerswap.json"
FIELDS = (
    "task",
    "filter",
    "metric",
    "value",
    "stderr",
    "num_fewshot",
    "samples",
    "lm_eval_version",
)


def model_index(name: str, scores: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Hugging Face's model-index: one result per task, its metrics as value and stderr."""
    results = []
    for task in sorted({s["task"] for s in scores}):
        rows = sorted(
            (s for s in scores if s["task"] == task), key=lambda s: (s["metric"], s["filter"])
        )
        results.append(
            {
                "task": {"type": "text-generation", "name": task},
                "dataset": {"type": task, "name": task},
                "metrics": [
                    {
                        "type": s["metric"],
                        "name": f"{s['metric']} ({s['filter']}, {s['num_fewshot']}-shot)",
                        "value": round(s["value"], 6),
                        **({"stderr": round(s["stderr"], 6)} if s["stderr"] is not None else {}),
                        "args": {
                            "filter": s["filter"],
                            "num_fewshot": s["num_fewshot"],
                            "samples": s["samples"],
                            "lm_eval": s["lm_eval_version"],
                        },
                    }
                    for s in rows
                ],
                "source": {"name": "layerswap (lm-evaluation-harness)", "url": ""},
            }
        )
    return [{"name": name, "results": results}]


def with_model_index(card: str, index: list[dict[str, Any]]) -> str:
    """The card with its front matter's model-index replaced (the rest kept as it was)."""
    front: dict[str, Any] = {}
    body = card
    if card.startswith("---\n") and "\n---\n" in card[4:]:
        head, body = card[4:].split("\n---\n", 1)
        loaded = yaml.safe_load(head)
        front = loaded if isinstance(loaded, dict) else {}
    front["model-index"] = index
    text = yaml.safe_dump(front, sort_keys=False, allow_unicode=True)
    return f"---\n{text}---\n{body}"


def write_model_index(
    db: Database,
    settings: Settings,
    artifact_id: str,
    location: Path,
    pending: list[dict[str, Any]],
) -> bool:
    """Rewrite the card of an output of ours with every score stored for it plus `pending`
    (this job's, not stored yet; they win over stored ones of the same task, filter and metric);
    True if the card changed."""
    if not location.is_relative_to(settings.artifacts_dir) or not (location / CARD).is_file():
        return False
    with db.session() as session:
        artifact = session.get(Artifact, artifact_id)
        if artifact is None or artifact.deleted_at is not None or CARD not in artifact.files:
            return False
        stored = session.scalars(
            select(EvaluationScore)
            .where(EvaluationScore.artifact_id == artifact_id)
            .order_by(EvaluationScore.id)
        )
        latest = {}  # the newest of each (task, filter, metric)
        for score in [*({c: getattr(s, c) for c in FIELDS} for s in stored), *pending]:
            latest[(score["task"], score["filter"], score["metric"])] = score
        card = (location / CARD).read_text(encoding="utf-8")
        updated = with_model_index(card, model_index(location.name, list(latest.values())))
        if updated == card:
            return False
        _replace(location / CARD, updated)
        files = _with_new_card(location, artifact.files)
        artifact.files = files
        artifact.content_digest = content_digest(files)
    return True


def _with_new_card(location: Path, files: dict[str, str]) -> dict[str, str]:
    """`files` with the rewritten card's sha256, which the output's manifest (rewritten too,
    its own sha256 then changed) lists as well."""
    files = dict(files)
    files[CARD] = file_sha256(location / CARD)
    manifest_path = location / MANIFEST
    if manifest_path.is_file() and MANIFEST in files:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        manifest.setdefault("outputs", {})[CARD] = files[CARD]
        _replace(manifest_path, json.dumps(manifest, indent=2) + "\n")  # as the engine does
        files[MANIFEST] = file_sha256(manifest_path)
    return files


def push_card(db: Database, settings: Settings, artifact_id: str, location: Path) -> list[str]:
    """The updated card (and manifest) in one extra commit on each Hub branch the model was
    published to, with the credential its merge used; commit ids made (none when the branch
    already has this card)."""
    with db.session() as session:
        artifact = session.get(Artifact, artifact_id)
        if artifact is None or not artifact.published:
            return []
        made_by = session.scalars(
            select(Job)
            .join(LineageEdge, LineageEdge.job_id == Job.id)
            .where(LineageEdge.artifact_id == artifact_id, LineageEdge.direction == "output")
        ).first()
        published = list(artifact.published)
        tenant = artifact.tenant_id
        destination = merge_recipe(made_by.request).output.hub if made_by is not None else None
    if destination is None:
        return []
    token = token_for(destination.credential, tenant=tenant, credentials=settings.hub_credentials)
    commits = []
    for entry in published:
        commit = publish_card(
            location,
            entry["repo"],
            entry["branch"],
            [CARD, MANIFEST],
            token=token,
            message="Add evaluation results",
        )
        if commit:
            commits.append(commit)
    return commits


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.card-tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
