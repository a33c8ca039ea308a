"""The output writer's two ways of hashing a written file, timed on one file in the page cache:
through a memory map (worker/engine/writer.py's `_hash_mapped`, the default) and through a
buffer that `preadv` fills (its fallback). Both must give the same sha256.

    .venv/bin/python bench/hash_paths.py bench/data/large/base/model-00001-of-00004.safetensors
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/cuda.py does
from worker.engine.writer import BLOCK, _hash_mapped


def mapped(fd: int, size: int) -> str:
    sha, done = hashlib.sha256(), 0
    while done < size:
        done = _hash_mapped(sha, fd, done, size)
    return sha.hexdigest()


def buffered(fd: int, size: int) -> str:
    sha, done, buffer = hashlib.sha256(), 0, bytearray(BLOCK)
    while done < size:
        view = memoryview(buffer)[: min(BLOCK, size - done)]
        n = os.preadv(fd, [view], done)
        sha.update(view[:n])
        done += n
    return sha.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    fd = os.open(args.file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    buffered(fd, size)  # into the page cache
    digests = set()
    for _ in range(args.reps):
        for name, way in (("memory map", mapped), ("preadv buffer", buffered)):
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            digests.add(way(fd, size))
            wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
            user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
            print(f"{name:>13}: {wall / size * 1e9:.3f} s per GB wall (user {user:.2f} s, "
                  f"system {system:.2f} s for {size / 1e9:.2f} GB)")  # fmt: skip
    os.close(fd)
    if len(digests) != 1:
        sys.exit("the two ways gave different sha256s")


if __name__ == "__main__":
    main()
