"""An output directory across attempts: what an earlier attempt left (leftovers to remove, or
a complete output to adopt), an earlier job's identical output to reuse, and the output of a
job canceled before recording it, removed. Whose output a directory is: core/output_manifest.py."""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select

from core import jobs
from core.db.models import Artifact, Job
from core.hub.refs import source_parts
from core.kinds import merge_recipe
from core.output_manifest import output_owner, read_manifest
from core.sources import resolve_source
from engine.io.digests import file_sha256
from engine.merge import MANIFEST, MergeResult
from engine.planner import make_plan
from engine.recipe import recipe_to_dict

log = logging.getLogger("layerswap.outputs")


def published_by_earlier_attempt(out_dir: Path, job_id: str) -> Any:
    """The MergeResult of an output this job already published, or None.

    An attempt that died after publishing (before recording) left a complete output: its
    manifest names this job and every file still has the sha256 it lists. Re-merging would
    only rewrite the same bytes, so the output is adopted as it is."""
    manifest = read_manifest(out_dir)
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


def made_by(out_dir: Path, job_id: str) -> bool:
    return output_owner(out_dir) == job_id


def discard_output(out_dir: Path, job_id: str) -> None:
    """Remove the output `job_id` published, its job canceled before recording it: renamed
    aside first (as the engine names a swapped-out output), so that a process dying mid-way
    leaves a leftover the next job of that name removes, never a half-deleted output holding
    the name. An output whose manifest names another job is left alone."""
    if not made_by(out_dir, job_id):
        return
    aside = out_dir.parent / f".{out_dir.name}.old-{uuid.uuid4().hex[:12]}"
    os.rename(out_dir, aside)
    shutil.rmtree(aside, ignore_errors=True)
    log.info("job %s: canceled; removed its output %s", job_id, out_dir)


# The engine's names beside an output (engine/merge.py): staging directories
# `.{name}.staging-{job id}-a{attempt}-{12 hex}` and swapped-out `.{name}.old-{12 hex}`.
_ATTEMPT_SUFFIX = re.compile(r"(\d+)-[0-9a-f]{12}")
_OLD_SUFFIX = re.compile(r"[0-9a-f]{12}")


def remove_leftovers(out_dir: Path, job_id: str, attempt: int) -> None:
    """Earlier attempts of this job, killed mid-write, leave staging (or swapped-out)
    directories beside the output. Only theirs are removed, matched by the exact names the
    engine makes: another job's, whose output name merely starts the same (`m` and `m.old-x`),
    or a live attempt's, are not ours to touch (earlier attempts are dead: the reconciler
    fenced them off)."""
    if not out_dir.parent.is_dir():
        return
    staging, old = f".{out_dir.name}.staging-{job_id}-a", f".{out_dir.name}.old-"
    for entry in out_dir.parent.iterdir():
        if entry.name.startswith(staging):
            match = _ATTEMPT_SUFFIX.fullmatch(entry.name.removeprefix(staging))
            if match and int(match[1]) < attempt:
                shutil.rmtree(entry, ignore_errors=True)
        elif entry.name.startswith(old) and _OLD_SUFFIX.fullmatch(entry.name.removeprefix(old)):
            shutil.rmtree(entry, ignore_errors=True)


def identical_output(
    job: Job, recipe: Any, db: Any, settings: Any, should_cancel: Any = None
) -> tuple[str, Any] | None:
    """(job id, MergeResult) of an earlier merge that made exactly what `recipe` would make
    now: the same recipe (its output options aside), the same plan digest, the same bytes in
    every input file its manifest lists, and its output intact. Sweeps use it so a
    configuration tried before is not merged again."""
    matches = _merges_of_same_recipe(job, recipe, db)
    if not matches:
        return None

    def resolve(source: str) -> Path:
        return resolve_source(source, settings, job.tenant_id)

    plan = make_plan(recipe, resolve=resolve, headers_only=True)
    digest = plan.digest()
    plan.close()
    cache = settings.cache_dir / "sha256"
    for earlier, _, location, files in matches:
        out_dir = Path(location)
        manifest = read_manifest(out_dir)
        if manifest is None or manifest.get("plan_digest") != digest:
            continue
        if _unchanged(manifest, out_dir, files, resolve, cache, should_cancel):
            return earlier, MergeResult(out_dir, dict(files), digest, manifest, 0.0)
    return None


def _merges_of_same_recipe(job: Job, recipe: Any, db: Any) -> list[Any]:
    """(job id, request, output location, output files) of this tenant's last 500 succeeded
    merges whose recipe, output options aside, is `recipe`; the newest first."""

    def without_output(r: Any) -> str:
        return jobs.request_digest({k: v for k, v in recipe_to_dict(r).items() if k != "output"})

    wanted = without_output(recipe)
    with db.session() as session:
        rows = session.execute(
            select(Job.id, Job.request, Artifact.location, Artifact.files)
            .join(Artifact, Artifact.id == Job.output_artifact_id)
            .where(Job.tenant_id == job.tenant_id, Job.kind == "merge", Job.id != job.id)
            .where(Job.status == jobs.SUCCEEDED, Artifact.deleted_at.is_(None))
            .order_by(Job.finished_at.desc())
            .limit(500)
        ).all()
    return [r for r in rows if without_output(merge_recipe(r.request)) == wanted]


def _unchanged(
    manifest: dict[str, Any],
    out_dir: Path,
    files: dict[str, str],
    resolve: Callable[[str], Path],
    cache: Path,
    should_cancel: Any,
) -> bool:
    """Whether every input file the manifest lists still has its bytes, and every output file
    (`files`) too. Both are hashed, whatever the first says (the cache keeps each sha256)."""
    same_inputs = all(
        file_sha256(resolve(part) / name, cache, should_cancel) == sha
        for entry in manifest["inputs"]
        for part, files in zip(
            source_parts(entry["source"]),
            (entry["files"], entry.get("adapter_files", {})),
            strict=False,
        )  # a model+adapter source: the model's files, then the adapter's
        for name, sha in files.items()
    )
    intact = all(
        (out_dir / name).is_file() and file_sha256(out_dir / name, cache, should_cancel) == sha
        for name, sha in files.items()
    )
    return same_inputs and intact
