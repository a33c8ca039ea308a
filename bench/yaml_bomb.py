"""What one YAML alias bomb costs the API: POST /v1/merges with `{"mergekit": "<yaml>"}`, a
valid config plus, under a key mergekit ignores, ten aliases a level, --levels deep (8: about
500 bytes standing for 10**7 strings; 9: about 550 bytes, 10**8), against a fresh `layerswap
serve` (SQLite, in-process executor) on the tiny example models. Reports the answer's status,
the time to it, whether GET /healthz answered while the bomb was in (sent just after it, 10 s
allowed), the jobs stored, the database's size, and the API process's resident memory before
the request and at its peak (VmHWM). A small config refused by its method goes first, so the
checks every request pays are not counted.

The server is watched as bench/sweep_bomb.py watches it: killed after --timeout seconds or once
its RSS passes --rss-limit-gb (then the figures read "> N s" and "> X GB"), its address space
capped at its idle size plus --rss-limit-gb as a backstop.

    .venv/bin/python bench/yaml_bomb.py
    git archive REF | tar -x -C /tmp/before && .venv/bin/python bench/yaml_bomb.py \\
        --before /tmp/before    # REF's code first, then this checkout's

--before and --after name checkouts whose code runs instead of the editable install's (on this
virtual environment, ahead of it on PYTHONPATH); --after defaults to the installed code. --out
also writes the report to a file, e.g. bench/figures/yaml-bomb-<the after code's short sha>.md.
"""

from __future__ import annotations

import argparse
import os
import sqlite3
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/api_load.py does
from bench.sweep_bomb import GIB, send_watched, start

MODELS = """\
models:
  - model: examples/math
    parameters: {weight: 0.5}
  - model: examples/swh
    parameters: {weight: 0.5}
"""


def bomb(levels: int) -> str:
    lines = ["merge_method: linear", MODELS.rstrip(), 'l0: &l0 "lol"']
    for level in range(1, levels):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * 10) + "]")
    return "\n".join([*lines, f"notes: *l{levels - 1}"]) + "\n"


@dataclass
class Outcome:
    code: str  # whose code ran
    status: str  # the HTTP status, or why there was none
    seconds: float
    killed: bool  # stopped by the watchdog: the figures are lower bounds
    health: str  # GET /healthz sent just after the bomb: its status, or why none
    stored: str  # jobs in the database afterwards, and the database's size
    idle_rss: int
    peak_rss: int
    message: str


def warm_up(base_url: str) -> None:
    """A config refused by its method: the translation's imports are paid here."""
    small = {"mergekit": "merge_method: nothing\n" + MODELS}
    response = httpx.post(f"{base_url}/v1/merges", json=small, timeout=120, trust_env=False)
    if response.status_code != 422:
        raise RuntimeError(f"warm-up: {response.status_code} {response.text[:300]}")


def post(base_url: str, text: str, answer: dict[str, str]) -> None:
    try:
        body = {"mergekit": text}
        response = httpx.post(f"{base_url}/v1/merges", json=body, timeout=None, trust_env=False)
        answer["status"] = str(response.status_code)
        answer["message"] = str(response.json().get("error", {}).get("message", "queued"))
    except (httpx.HTTPError, ValueError) as e:
        answer["status"] = f"no answer ({type(e).__name__})"


def health(base_url: str, answer: dict[str, str]) -> None:
    try:
        got = httpx.get(f"{base_url}/healthz", timeout=10, trust_env=False)
        answer["health"] = str(got.status_code)
    except httpx.HTTPError as e:
        answer["health"] = f"no answer ({type(e).__name__})"


def stored(work: Path) -> str:
    database = work / "data" / "layerswap.db"
    with sqlite3.connect(database) as connection:
        (jobs,) = connection.execute("SELECT count(*) FROM jobs").fetchone()
    return f"{jobs} jobs, {database.stat().st_size / 1024**2:.1f} MB"


def measure(code: Path | None, levels: int, timeout: float, limit: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="yaml-bomb-") as tmp:
        server, base_url = start(Path(tmp), code)
        try:
            warm_up(base_url)
            answer = {"status": "killed", "message": "", "health": "not asked"}
            sent = send_watched(server, lambda: post(base_url, bomb(levels), answer), timeout,
                                limit, meanwhile=lambda: health(base_url, answer))  # fmt: skip
        finally:
            server.kill()
            server.wait()
        rows = stored(Path(tmp))
    name = str(code) if code else "this checkout"
    return Outcome(name, answer["status"], sent.seconds, sent.killed, answer["health"], rows,
                   sent.idle_rss, sent.peak_rss, answer["message"])  # fmt: skip


def row(outcome: Outcome) -> str:
    more = "> " if outcome.killed else ""
    return (
        f"| {outcome.code} | {outcome.status} | {more}{outcome.seconds:.2f} s | "
        f"{outcome.health} | {outcome.stored} | {outcome.idle_rss / GIB:.2f} GB | "
        f"{more}{outcome.peak_rss / GIB:.2f} GB | {outcome.message[:200]} |"
    )


def report(outcomes: list[Outcome], args: argparse.Namespace, load: float) -> str:
    size = len(bomb(args.levels).encode())
    command = " ".join([".venv/bin/python", "bench/yaml_bomb.py", *sys.argv[1:]])
    lines = [
        f"# POST /v1/merges with a {size}-byte mergekit YAML of 10^{args.levels - 1} aliased "
        "strings",
        "",
        f"`{command}` on {os.cpu_count()} CPUs (load average {load:.1f} at the start); a fresh "
        "`layerswap serve` per run, warmed up by a config refused by its method (RSS idle is "
        f"after it); killed past {args.timeout:.0f} s or {args.rss_limit_gb:.1f} GB RSS "
        "(then '>').",
        "",
        "| code | status | time to answer | /healthz meanwhile | stored | RSS idle | "
        "peak RSS (VmHWM) | message |",
        "|---|---|---:|---|---|---:|---:|---|",
        *(row(o) for o in outcomes),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--before", type=Path, help="a checkout whose code runs first")
    parser.add_argument("--after", type=Path, help="the checkout measured second")
    parser.add_argument("--levels", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--rss-limit-gb", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    limit = int(args.rss_limit_gb * GIB)
    load = os.getloadavg()[0]
    outcomes = []
    if args.before is not None:
        outcomes.append(measure(args.before.resolve(), args.levels, args.timeout, limit))
    after = args.after.resolve() if args.after else None
    outcomes.append(measure(after, args.levels, args.timeout, limit))
    text = report(outcomes, args, load)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
