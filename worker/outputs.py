"""An output directory across attempts: what an earlier attempt left (leftovers to remove, or
a complete output to adopt) and whose output a directory is."""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session

from service import jobs
from service.db.models import Job
from service.errors import Conflict

log = logging.getLogger("layerswap.outputs")


def published_by_earlier_attempt(out_dir: Path, job_id: str) -> Any:
    """The MergeResult of an output this job already published, or None.

    An attempt that died after publishing (before recording) left a complete output: its
    manifest names this job and every file still has the sha256 it lists. Re-merging would
    only rewrite the same bytes, so the output is adopted as it is."""
    from worker.engine.digests import file_sha256
    from worker.engine.merge import MANIFEST, MergeResult

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


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    from worker.engine.merge import MANIFEST

    try:
        data = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def output_owner(out_dir: Path) -> str | None:
    """The id of the job whose manifest the output holds (None: no readable manifest)."""
    manifest = read_manifest(out_dir)
    job = manifest.get("job") if manifest else None
    owner = job.get("id") if isinstance(job, dict) else None
    return owner if isinstance(owner, str) else None


def remove_orphan(out_dir: Path, job_id: str) -> bool:
    """Remove an output that `job_id` published but never recorded, once that job has ended
    without succeeding (canceled, or out of attempts after a lost attempt had published): it
    would stay forever and hold its name. Only an output whose manifest names that job."""
    if output_owner(out_dir) != job_id:
        return False
    shutil.rmtree(out_dir, ignore_errors=True)
    return not out_dir.exists()


# The engine's names beside an output (worker/engine/merge.py): staging directories
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


def free_name(session: Session, out_dir: Path, tenant: str) -> None:
    """409 if an output already holds this name, unless that output is an orphan: published by
    a job of this tenant's that then ended without succeeding (its manifest names the job),
    which is removed. Never another job's live output, nor a succeeded job's."""
    if not out_dir.exists():
        return
    owner_id = output_owner(out_dir)
    owner = session.get(Job, owner_id) if owner_id and jobs.is_id(owner_id) else None
    if (
        owner is None
        or owner.tenant_id != tenant
        or owner.status not in (jobs.FAILED, jobs.CANCELED)
    ):
        raise Conflict(
            f"output.name: an artifact named {out_dir.name!r} already exists",
            details={"field": "output.name"},
        )
    remove_orphan(out_dir, owner.id)
    log.warning("job %s ended %s: removed its orphaned output %s", owner.id, owner.status, out_dir)


def identical_output(
    job: Job, recipe: Any, db: Any, settings: Any, should_cancel: Any = None
) -> tuple[str, Any] | None:
    """(job id, MergeResult) of an earlier merge that made exactly what `recipe` would make
    now: the same recipe (its output options aside), the same plan digest, the same bytes in
    every input file its manifest lists, and its output intact. Sweeps use it so a
    configuration tried before is not merged again."""
    from service.sources import resolve_source
    from worker.engine.merge import MergeResult
    from worker.engine.planner import make_plan

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
    from sqlalchemy import select

    from service.db.models import Artifact
    from service.kinds import merge_recipe
    from worker.engine.recipe import recipe_to_dict

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
    from worker.engine.digests import file_sha256

    same_inputs = all(
        file_sha256(resolve(entry["source"]) / name, cache, should_cancel) == sha
        for entry in manifest["inputs"]
        for name, sha in entry["files"].items()
    )
    intact = all(
        (out_dir / name).is_file() and file_sha256(out_dir / name, cache, should_cancel) == sha
        for name, sha in files.items()
    )
    return same_inputs and intact
