"""What the first request with an evaluation costs a fresh API process. Each measurement starts
its own `layerswap serve` (SQLite, in-process executor, the tiny example models), waits for
/readyz, and sends one request, timed from the client: then the same request again (the
process warm). Cases:

- `grid`: the 6.3 M-combination sweep of bench/sweep_bomb.py, refused at its budget (422);
- `sweep`: a valid sweep of 2 layer-swap configurations on one pair (202);
- `merge`: a layer swap with an `evaluation` block (202).

Each also reports the time from the server's start to ready and its resident memory (RSS) once
the first answer has come: a check that imports lm-eval (with pandas, pyarrow, datasets) shows
there as about 0.1 GB more.

    .venv/bin/python bench/first_request.py [--reps 3] [--cases grid,sweep,merge]
    git archive REF | tar -x -C /tmp/before && .venv/bin/python bench/first_request.py \\
        --before /tmp/before    # REF's service/, worker/ and core/ first, then this checkout's

--before and --after name checkouts whose code runs instead of the editable install's (as
bench/sweep_bomb.py: on this virtual environment, ahead of it on PYTHONPATH); --after defaults
to the installed code. --out also writes the report to a file.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/api_load.py does
from bench.sweep_bomb import GIB, TASK, bomb, proc_kib, start


def small_sweep() -> dict[str, Any]:
    return {**bomb(), "grid": {"bottom": [1, 2], "top": [1]}}


def merge_with_evaluation() -> dict[str, Any]:
    return {
        "method": "layer_swap",
        "experts": {"task": ["examples/math"], "language": ["examples/swh"]},
        "params": {"bottom": 1, "top": 1},
        "evaluation": {"tasks": [TASK]},
    }


CASES: dict[str, tuple[str, Callable[[], dict[str, Any]], int]] = {
    "grid": ("/v1/sweeps", bomb, 422),
    "sweep": ("/v1/sweeps", small_sweep, 202),
    "merge": ("/v1/merges", merge_with_evaluation, 202),
}


@dataclass
class Run:
    ready_s: float  # from the server process's start to /readyz 200
    first_s: float
    again_s: float
    rss: int  # after the first answer


def process_age(pid: int) -> float:
    """Seconds since the process started (start() makes the example models before it)."""
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - started / os.sysconf("SC_CLK_TCK")


def timed_post(base_url: str, path: str, body: dict[str, Any], expected: int) -> float:
    started = time.perf_counter()
    response = httpx.post(f"{base_url}{path}", json=body, timeout=300, trust_env=False)
    seconds = time.perf_counter() - started
    if response.status_code != expected:
        raise RuntimeError(f"{path}: {response.status_code} {response.text[:300]}")
    return seconds


def measure(code: Path | None, case: str) -> Run:
    path, body, expected = CASES[case]
    with tempfile.TemporaryDirectory(prefix="first-request-") as tmp:
        server, base_url = start(Path(tmp), code)
        try:
            ready_s = process_age(server.pid)
            first = timed_post(base_url, path, body(), expected)
            rss = proc_kib(server.pid, "VmRSS")
            again = timed_post(base_url, path, body(), expected)
        finally:
            server.kill()
            server.wait()
    return Run(ready_s, first, again, rss)


def spread(values: list[float], unit: str = "s", scale: float = 1.0) -> str:
    """The median, and the range when there is more than one value."""
    scaled = [v / scale for v in values]
    median = f"{statistics.median(scaled):.3f} {unit}"
    if len(scaled) == 1:
        return median
    return f"{median} ({min(scaled):.3f}–{max(scaled):.3f})"


def row(code: str, case: str, runs: list[Run]) -> str:
    return (
        f"| {code} | {case} | {spread([r.first_s for r in runs])} | "
        f"{spread([r.again_s for r in runs])} | {spread([r.ready_s for r in runs])} | "
        f"{spread([float(r.rss) for r in runs], 'GB', GIB)} |"
    )


def report(rows: list[str], reps: int, load: float) -> str:
    command = " ".join([".venv/bin/python", "bench/first_request.py", *sys.argv[1:]])
    lines = [
        "# The first request with an evaluation on a fresh `layerswap serve`",
        "",
        f"`{command}` on {os.cpu_count()} CPUs (load average {load:.1f} at the start); a fresh "
        f"server per measurement, {reps} per row: median (min–max).",
        "",
        "| code | case | first request | the same again | start to ready | RSS after the first |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--before", type=Path, help="a checkout whose code runs first")
    parser.add_argument(
        "--after", type=Path, help="the checkout measured second (default: installed)"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    load = os.getloadavg()[0]
    codes: list[Path | None] = [args.before.resolve()] if args.before else []
    codes.append(args.after.resolve() if args.after else None)
    rows = []
    for code in codes:
        name = str(code) if code else "this checkout"
        for case in args.cases.split(","):
            runs = [measure(code, case) for _ in range(args.reps)]
            rows.append(row(name, case, runs))
            print(rows[-1], file=sys.stderr, flush=True)
    text = report(rows, args.reps, load)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
