"""The output writer's two ways of writing a file, timed on copies of one input file in the
page cache: O_DIRECT (engine/io/writer.py's default) and through the page cache (its
fallback where a file system refuses O_DIRECT). Each run writes the whole file as one copy,
hashes it and fdatasyncs it, as a layer swap does its copied tensors; both must give the
input's sha256.

    .venv/bin/python bench/write_paths.py bench/data/large/base/model-00001-of-00004.safetensors
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/cuda.py does
from engine.io.digests import file_sha256
from engine.io.writer import OutputWriter


def write_copy(source: int, size: int, directory: Path, *, direct: bool) -> str:
    writer = OutputWriter(directory, [("out.bin", b"", size)], direct=direct)
    writer.put_copy(0, 0, source, 0, size)
    writer.finish()
    return writer.digests["out.bin"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after each sync")
    args = parser.parse_args()
    fd = os.open(args.file, os.O_RDONLY)
    size = os.fstat(fd).st_size
    expected = file_sha256(args.file)  # and the file is in the page cache
    out_root = Path(tempfile.mkdtemp(prefix="write-paths-", dir=args.file.parent))
    try:
        for rep in range(args.reps):
            ways = [("O_DIRECT", True), ("page cache", False)]
            for name, direct in ways if rep % 2 == 0 else ways[::-1]:  # alternate who goes first
                out = out_root / f"{rep}-{direct}"
                out.mkdir()
                subprocess.run(["sync"], check=True)
                time.sleep(args.settle)
                before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                digest = write_copy(fd, size, out, direct=direct)
                wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF)
                user, system = after.ru_utime - before.ru_utime, after.ru_stime - before.ru_stime
                print(f"{name:>10}: {wall:.2f} s wall, user {user:.2f} s, system {system:.2f} s "
                      f"for {size / 1e9:.2f} GB")  # fmt: skip
                if digest != expected:
                    sys.exit(f"{name}: sha256 {digest} is not the input's {expected}")
                shutil.rmtree(out)
    finally:
        os.close(fd)
        shutil.rmtree(out_root, ignore_errors=True)


if __name__ == "__main__":
    main()
