"""sha256 of input files, remembered across runs by (path, size, mtime, ctime, device, inode).

Hashing a multi-GB input costs seconds; a merge sweep reads the same experts again and again.
The cache is a directory of small JSON files, written atomically, safe for concurrent use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

from engine.errors import MergeCanceled

BLOCK = 8 * 1024 * 1024


def file_sha256(
    path: Path, cache_dir: Path | None = None, should_stop: Callable[[], bool] | None = None
) -> str:
    """The file's sha256. `should_stop` is asked between blocks: a canceled merge does not wait
    for a multi-GB input to be hashed (MergeCanceled)."""
    real = path.resolve()
    stat = real.stat()
    # ctime changes on every write and rename, even one that restores the mtime (cp -p, rsync).
    identity = [str(real), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_dev,
                stat.st_ino]  # fmt: skip
    entry = None
    if cache_dir is not None:
        entry = cache_dir / (hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")
        try:
            cached = json.loads(entry.read_text())
            if isinstance(cached, dict) and cached.get("identity") == identity:
                return str(cached["sha256"])
        except (OSError, ValueError, KeyError):
            pass
    digest = _hash_file(real, should_stop)
    if entry is not None:
        _remember(entry, {"identity": identity, "sha256": digest})
    return digest


def _remember(entry: Path, record: dict[str, object]) -> None:
    """Best effort: a cache that cannot be written (disk full, read-only) costs a re-hash next
    time, never the merge; no partial entry is left."""
    tmp = entry.with_suffix(f".{os.getpid()}.tmp")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(record))
        os.replace(tmp, entry)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()


def _hash_file(path: Path, should_stop: Callable[[], bool] | None = None) -> str:
    sha = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            if should_stop is not None and should_stop():
                raise MergeCanceled(f"stopped while hashing {path}")
            sha.update(view[:n])
    return sha.hexdigest()
