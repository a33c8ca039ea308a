"""Whose output a directory is: the manifest the engine writes beside a merge's files names the
job that made it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from engine.merge import MANIFEST


def read_manifest(out_dir: Path) -> dict[str, Any] | None:
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
