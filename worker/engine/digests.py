"""sha256 of input files, remembered across runs by (path, size, mtime, inode).

Hashing a multi-GB input costs seconds; a merge sweep reads the same experts again and again.
The cache is a directory of small JSON files, written atomically, safe for concurrent use.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

BLOCK = 8 * 1024 * 1024


def file_sha256(path: Path, cache_dir: Path | None = None) -> str:
    real = path.resolve()
    stat = real.stat()
    identity = [str(real), stat.st_size, stat.st_mtime_ns, stat.st_ino]
    entry = None
    if cache_dir is not None:
        entry = cache_dir / (hashlib.sha256(str(real).encode()).hexdigest()[:32] + ".json")
        try:
            cached = json.loads(entry.read_text())
            if cached.get("identity") == identity:
                return str(cached["sha256"])
        except (OSError, ValueError, KeyError):
            pass
    digest = _hash_file(real)
    if entry is not None:
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = entry.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"identity": identity, "sha256": digest}))
        os.replace(tmp, entry)
    return digest


def _hash_file(path: Path) -> str:
    sha = hashlib.sha256()
    buffer = bytearray(BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            sha.update(view[:n])
    return sha.hexdigest()
