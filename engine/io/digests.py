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
from io import FileIO
from pathlib import Path

from engine.errors import MergeCanceled
from engine.io.file_access import Opener, opened_path

BLOCK = 8 * 1024 * 1024


def file_sha256(
    path: Path,
    cache_dir: Path | None = None,
    should_stop: Callable[[], bool] | None = None,
    opener: Opener | None = None,
) -> str:
    """The file's sha256. `should_stop` is asked between blocks: a canceled merge does not wait
    for a multi-GB input to be hashed (MergeCanceled). With `opener` (a checkpoint's,
    engine/io/file_access.py) the file is opened first and known by what was opened: one its
    guard refuses is neither read nor looked up in the cache."""
    if opener is None:
        real = path.resolve()
        return _digest(real, real.stat(), cache_dir, lambda: _hash_file(real, should_stop))
    with os.fdopen(opener(path), "rb", buffering=0) as f:
        real = opened_path(f.fileno(), path)
        return _digest(
            real, os.fstat(f.fileno()), cache_dir, lambda: _hash_stream(f, path, should_stop)
        )


def content_digest(files: dict[str, str]) -> str:
    """One digest over a checkpoint's file sha256s (name -> sha256): same files, same
    identity (an artifact's, in the service's lineage)."""
    lines = "".join(f"{name}\0{sha}\n" for name, sha in sorted(files.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def _digest(
    real: Path, stat: os.stat_result, cache_dir: Path | None, compute: Callable[[], str]
) -> str:
    """The cached sha256 of the file `real` as `stat` describes it, else compute()'s (then
    cached)."""
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
    digest = compute()
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
    with open(path, "rb", buffering=0) as f:
        return _hash_stream(f, path, should_stop)


def _hash_stream(f: FileIO, path: Path, should_stop: Callable[[], bool] | None) -> str:
    sha = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    while n := f.readinto(buffer):
        if should_stop is not None and should_stop():
            raise MergeCanceled(f"stopped while hashing {path}")
        sha.update(view[:n])
    return sha.hexdigest()
