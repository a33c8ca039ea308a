"""A layer swap against the physical floor, `cp -r` + `sync` of one input, in alternating pairs.

The disk's write speed drifts by 2-4x over minutes here (a run after a long one, or after
another writer, often waits on writeback it did not cause), so a median over rounds far apart
says little about a ratio. This runs the two commands back to back, `--pairs` times, in
alternating order (swap first in odd pairs, copy first in even ones), each exactly as
bench/run.py runs it (output removed and `sync` before, inputs read into the page cache), and
reports every pair's ratio and their median.

    .venv/bin/python bench/swap_vs_copy.py --preset large --pairs 8 --settle 20

`--settle` waits that long before each run: here the second command of a pair otherwise pays
for the first one's writes (its fsynced bytes are still being flushed further down, by the
host), whichever command it is.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/cuda.py does
from bench.run import DATA_DIR, RESULTS_DIR, ROOT, build_cases, remove, run_case

SWAP, COPY = "layer_swap/layerswap", "copy/cp + sync of its files"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="large")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument(
        "--settle", type=float, default=0.0, help="seconds to wait (after sync) before each run"
    )
    args = parser.parse_args()
    preset = DATA_DIR / args.preset
    if not (preset / "complete.json").is_file():
        sys.exit(f"{preset}: no checkpoints; run make_checkpoints.py --preset {args.preset}")
    layers = int(json.loads((preset / "complete.json").read_text())["layers"])
    models = {m: preset / m for m in ("base", "task", "lang")}
    work = preset / "work"
    (work / "logs").mkdir(parents=True, exist_ok=True)
    cases = {c.key: c for c in build_cases(work, models, layers, ["layer_swap"])}
    swap, copy = cases[SWAP], cases[COPY]

    pairs: list[tuple[float, float]] = []
    for i in range(args.pairs):
        order = (swap, copy) if i % 2 == 0 else (copy, swap)
        walls = {}
        for c in order:
            subprocess.run(["sync"], check=True)
            time.sleep(args.settle)
            walls[c.key] = run_case(c, work / "logs", work / "sha256-cache").wall_s
        for c in order:
            remove(c.out)
        pairs.append((walls[SWAP], walls[COPY]))
        print(f"pair {i + 1}: swap {walls[SWAP]:.2f} s, cp + sync {walls[COPY]:.2f} s, "
              f"ratio {walls[SWAP] / walls[COPY]:.2f}", flush=True)  # fmt: skip

    ratios = [s / c for s, c in pairs]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    lines = [
        f"# Layer swap vs cp + sync, preset `{args.preset}`, {args.pairs} alternating pairs",
        "",
        f"Command: `.venv/bin/python bench/swap_vs_copy.py --preset {args.preset} "
        f"--pairs {args.pairs} --settle {args.settle:g}`",
        "",
        f"layerswap at {commit}; {os.cpu_count()} CPUs, {platform.machine()}, kernel "
        f"{platform.release()}; "
        f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}.",
        "",
        "| pair | layer swap s (default: fsync on) | cp -r + sync s | ratio |",
        "|---:|---:|---:|---:|",
        *(f"| {i + 1} | {s:.2f} | {c:.2f} | {s / c:.2f} |" for i, (s, c) in enumerate(pairs)),
        "",
        f"Median: layer swap {statistics.median(s for s, _ in pairs):.2f} s, cp + sync "
        f"{statistics.median(c for _, c in pairs):.2f} s; median of the pairs' ratios "
        f"**{statistics.median(ratios):.2f}** (range {min(ratios):.2f}-{max(ratios):.2f}).",
        "",
    ]
    RESULTS_DIR.mkdir(exist_ok=True)
    out = RESULTS_DIR / f"swap-vs-copy-{args.preset}.md"
    out.write_text("\n".join(lines))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
