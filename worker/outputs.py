"""An output directory across attempts: what an earlier attempt left (leftovers to remove, or
a complete output to adopt) and whose output a directory is."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any


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
    manifest = read_manifest(out_dir)
    return manifest is not None and manifest.get("job", {}).get("id") == job_id


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
    from worker.engine.merge import MANIFEST

    try:
        data = json.loads((out_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def remove_leftovers(out_dir: Path, job_id: str, attempt: int) -> None:
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
