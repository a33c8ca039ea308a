"""Time the two inner loops a soup spends its CPU on, in-process: the output's sha256, and the
linear kernel's arithmetic.

- sha256 of 256 MB, hashed as the writer once did (8 MB blocks, long after they were filled)
  and as it does now (each 512 KB slice right after it is copied in, still in the core's cache);
- the compiled linear kernel (`engine.kernels.linear._combine`, one thread, inputs in cache) on
  standard-normal values (random bits would be 1 in 256 subnormals, which cost microcode assists
  on Intel CPUs and no checkpoint holds) for the cases a merge meets.

    .venv/bin/python bench/cpu_paths.py                  # this checkout
    .venv/bin/python bench/cpu_paths.py --root /tmp/old  # another (a `git worktree`), to compare
"""

from __future__ import annotations

import argparse
import hashlib
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
ELEMENTS = 1 << 16  # per kernel call: the inputs (≤ 512 KB) stay in the L2 cache


def best_rate(run: Any, nbytes: int, repeats: int = 5) -> float:
    """G`nbytes`/s (GB/s, or G elements/s) of the fastest of `repeats` runs."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def hashing() -> list[tuple[str, float]]:
    source = np.random.default_rng(0).integers(0, 256, 256 * MB, np.uint8)
    view = source.data

    def blocks_afterwards() -> None:
        sha = hashlib.sha256()
        for at in range(0, len(view), 8 * MB):
            sha.update(view[at : at + 8 * MB])

    block = memoryview(bytearray(8 * MB))

    def slices_while_hot() -> None:
        sha = hashlib.sha256()
        for at in range(0, len(view), 512 * 1024):
            part = block[at % (8 * MB) : at % (8 * MB) + 512 * 1024]
            part[:] = view[at : at + 512 * 1024]
            sha.update(part)

    def copy_only() -> None:
        for at in range(0, len(view), 512 * 1024):
            block[at % (8 * MB) : at % (8 * MB) + 512 * 1024] = view[at : at + 512 * 1024]

    return [
        ("sha256 of 8 MB blocks, filled earlier", best_rate(blocks_afterwards, len(view))),
        ("copy + sha256 of each 512 KB slice (the writer)", best_rate(slices_while_hot, len(view))),
        ("the copy alone", best_rate(copy_only, len(view))),
    ]


def kernel(linear_kernels: Any) -> list[tuple[str, float]]:
    dtypes = ["BF16", "F16", "F32"]  # the compiled code's kinds 0, 1, 2
    cases = [  # (name, stored kinds, coefficients, fused, divisor, output kind)
        ("soup of two, BF16 (mean)", [0, 0], [1.0, 1.0], True, 2.0, 0),
        ("linear of two, BF16", [0, 0], [0.3, 0.7], False, 1.0, 0),
        ("soup of two, F16", [1, 1], [1.0, 1.0], True, 2.0, 1),
        ("soup of two, F32", [2, 2], [1.0, 1.0], True, 2.0, 2),
        ("soup of three, BF16", [0, 0, 0], [1.0, 1.0, 1.0], True, 3.0, 0),
    ]
    rng = np.random.default_rng(0)
    rates = []
    for name, kinds, coefficients, fused, divisor, out_kind in cases:
        values = rng.standard_normal((len(kinds), ELEMENTS)).astype(np.float32)
        rows = np.stack([linear_kernels.narrow(v, dtypes[kinds[0]]).view(np.uint8) for v in values])
        out = np.empty(ELEMENTS * 4, np.uint8)
        args = (
            rows, np.array(kinds, np.int64), np.array(coefficients, np.float32), fused,
            np.float32(divisor), out_kind, out, 0, ELEMENTS,
        )  # fmt: skip
        linear_kernels._combine(*args)  # compiled (or loaded from the cache) first

        def calls(args: tuple[Any, ...] = args) -> None:
            for _ in range(200):
                linear_kernels._combine(*args)

        rates.append((name, 1 / best_rate(calls, 200 * ELEMENTS)))  # G elements/s -> ns each
    return rates


def cpu_name() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="checkout whose kernel to time")
    args = parser.parse_args()
    sys.path.insert(0, str(args.root))
    from engine.kernels import linear as linear_kernels

    commit = subprocess.run(
        ["git", "-C", str(args.root), "rev-parse", "--short", "HEAD"],
        capture_output=True, text=True, check=False,
    ).stdout.strip()  # fmt: skip
    print(f"{cpu_name()}; kernel from {args.root} at {commit}\n")
    print("| sha256 | GB/s |\n|---|---:|")
    for name, rate in hashing():
        print(f"| {name} | {rate:.2f} |")
    print("\n| linear kernel, one thread | ns / element |\n|---|---:|")
    for name, ns in kernel(linear_kernels):
        print(f"| {name} | {ns:.3f} |")


if __name__ == "__main__":
    main()
