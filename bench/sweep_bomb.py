"""What one oversized sweep request costs the API: a POST /v1/sweeps of about 1 KB whose grid
lists 64 × 64 × 16 × 16 × 2 × 3 values (6,291,456 combinations; 1,260 fit the example models'
6 layers, more than the default budget of 200 jobs) against a fresh `layerswap serve` (SQLite,
in-process executor) on the tiny example models. Reports the answer's status, the time to it,
and the API process's resident memory before the request and at its peak (VmHWM). A small
sweep refused at its budget goes first, so the checks every request pays are not counted.

The server is watched so that code which builds the grid cannot take the machine's memory: it
is killed after --timeout seconds or once its RSS passes --rss-limit-gb (then the figures read
"> N s" and "> X GB"), and its address space is capped (RLIMIT_AS) at its idle size plus
--rss-limit-gb as a backstop.

    .venv/bin/python bench/sweep_bomb.py
    git archive REF | tar -x -C /tmp/before && .venv/bin/python bench/sweep_bomb.py \\
        --before /tmp/before    # REF's service/ and worker/ first, then this checkout's

--before and --after name checkouts (e.g. `git archive` exports) whose service/ and worker/
packages run instead of the editable install's, on this virtual environment; --after defaults
to the installed code. --out writes the report (every run) to a file as well, e.g.
bench/figures/sweep-bomb-<the after code's short sha>.md.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
LAYERSWAP = Path(sys.executable).parent / "layerswap"  # this virtual environment's
TASK = "mgsm_local_direct_sw"
GIB = 1024**3


def bomb() -> dict[str, object]:
    return {
        "task_experts": ["examples/math"],
        "language_experts": ["examples/swh"],
        "base": "examples/base",
        "grid": {
            "bottom": list(range(64)),
            "top": list(range(64)),
            "bottom_transition": list(range(16)),
            "top_transition": list(range(16)),
            "transition_weights": ["uniform", "magnitude"],
            "non_layer": ["average", "task", "language"],
        },
        "evaluation": {"tasks": [TASK]},
        "objective": {"task": TASK},
    }


@dataclass
class Outcome:
    code: str  # whose service/ and worker/ ran
    status: str  # the HTTP status, or why there was none
    seconds: float
    killed: bool  # stopped by the watchdog: the figures are lower bounds
    idle_rss: int
    peak_rss: int
    message: str


def proc_kib(pid: int, field: str) -> int:
    """A /proc/<pid>/status field in bytes (0 once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start(work: Path, code: Path | None) -> tuple[subprocess.Popen[bytes], str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    if code is not None:
        env["PYTHONPATH"] = str(code)  # ahead of the editable install's finder
        where = [sys.executable, "-c", "import service; print(service.__file__)"]
        imported = subprocess.run(where, env=env, cwd=work, check=True, capture_output=True)
        if not Path(imported.stdout.decode().strip()).is_relative_to(code):
            raise RuntimeError(f"{code}'s code is not what would run")
    data = work / "data"
    examples = [str(LAYERSWAP), "examples", str(data / "checkpoints" / "examples")]
    subprocess.run(examples, check=True, stdout=subprocess.DEVNULL, env=env)
    port = free_port()
    env.update(LAYERSWAP_DATA_DIR=str(data), LAYERSWAP_HOST="127.0.0.1", LAYERSWAP_PORT=str(port))
    log = (work / "serve.log").open("wb")
    server = subprocess.Popen([str(LAYERSWAP), "serve"], env=env, stdout=log, stderr=log)
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while not ready(base_url):
        if server.poll() is not None or time.monotonic() > deadline:
            server.kill()
            raise RuntimeError(f"layerswap serve did not start: see {work / 'serve.log'}")
        time.sleep(0.2)
    return server, base_url


def ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/readyz", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


def warm_up(base_url: str) -> None:
    """A small sweep refused at its budget: the checks on the way (the sources, the model's
    depth) are paid here, so the measured request costs only its grid."""
    small = {**bomb(), "grid": {"bottom": list(range(6)), "top": [0, 1]}, "budget": 5}
    response = httpx.post(f"{base_url}/v1/sweeps", json=small, timeout=120, trust_env=False)
    if response.status_code != 422 or "budget" not in response.text:
        raise RuntimeError(f"warm-up: {response.status_code} {response.text[:300]}")


def post(base_url: str, answer: dict[str, object]) -> None:
    try:
        response = httpx.post(f"{base_url}/v1/sweeps", json=bomb(), timeout=None, trust_env=False)
        answer["status"] = str(response.status_code)
        answer["message"] = str(response.json().get("error", {}).get("message", ""))
    except (httpx.HTTPError, ValueError) as e:
        answer["status"] = f"no answer ({type(e).__name__})"


def measure(code: Path | None, timeout: float, limit: int) -> Outcome:
    with tempfile.TemporaryDirectory(prefix="sweep-bomb-") as tmp:
        server, base_url = start(Path(tmp), code)
        try:
            warm_up(base_url)
            answer: dict[str, object] = {"status": "killed", "message": ""}
            sent = send_watched(server, lambda: post(base_url, answer), timeout, limit)
        finally:
            server.kill()
            server.wait()
    name = str(code) if code else "this checkout"
    status, message = str(answer["status"]), str(answer["message"])
    return Outcome(name, status, sent.seconds, sent.killed, sent.idle_rss, sent.peak_rss, message)


@dataclass
class Sent:
    seconds: float  # to the answer, or to the kill
    killed: bool
    idle_rss: int  # before the request
    peak_rss: int


def send_watched(
    server: subprocess.Popen[bytes],
    send: Callable[[], None],
    timeout: float,
    limit: int,
    meanwhile: Callable[[], None] = lambda: None,
) -> Sent:
    """Cap the server's address space at its size now plus `limit`, `send` one request from a
    thread, run `meanwhile` (another request while that one is in), and watch the server until
    the answer comes (killed past `timeout` or `limit`)."""
    idle = proc_kib(server.pid, "VmRSS")
    cap = proc_kib(server.pid, "VmSize") + limit
    resource.prlimit(server.pid, resource.RLIMIT_AS, (cap, cap))
    client = threading.Thread(target=send, daemon=True)
    started = time.monotonic()
    client.start()
    meanwhile()
    peak, killed = watch(server, client, started, timeout, limit)
    seconds = time.monotonic() - started
    return Sent(seconds, killed, idle, max(peak, proc_kib(server.pid, "VmHWM")))


def watch(
    server: subprocess.Popen[bytes],
    client: threading.Thread,
    started: float,
    timeout: float,
    limit: int,
) -> tuple[int, bool]:
    """Poll the server's RSS until the answer comes; kill it past the time or memory limit.
    Returns the highest RSS seen and whether it was killed."""
    peak = 0
    while client.is_alive():
        peak = max(peak, proc_kib(server.pid, "VmRSS"))
        if time.monotonic() - started > timeout or peak > limit:
            server.kill()
            client.join(timeout=10)
            return peak, True
        time.sleep(0.05)
    return peak, False


def row(outcome: Outcome) -> str:
    more = "> " if outcome.killed else ""
    return (
        f"| {outcome.code} | {outcome.status} | {more}{outcome.seconds:.2f} s | "
        f"{outcome.idle_rss / GIB:.2f} GB | {more}{outcome.peak_rss / GIB:.2f} GB | "
        f"{outcome.message[:300]} |"
    )


def report(outcomes: list[Outcome], timeout: float, limit_gb: float, load: float) -> str:
    size = len(httpx.Request("POST", "http://x", json=bomb()).content)
    command = " ".join([".venv/bin/python", "bench/sweep_bomb.py", *sys.argv[1:]])
    lines = [
        f"# POST /v1/sweeps with a {size}-byte grid of 64 × 64 × 16 × 16 × 2 × 3 values",
        "",
        f"`{command}` on {os.cpu_count()} CPUs (load average {load:.1f} at the start); a fresh "
        "`layerswap serve` per run, warmed up by a small sweep refused at its budget (RSS idle "
        f"is after it); killed past {timeout:.0f} s or {limit_gb:.1f} GB RSS (then '>').",
        "",
        "| code | status | time to answer | RSS idle | peak RSS (VmHWM) | message |",
        "|---|---|---:|---:|---:|---|",
        *(row(o) for o in outcomes),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--before", type=Path, help="a checkout whose code runs first")
    parser.add_argument(
        "--after", type=Path, help="the checkout measured second (default: installed)"
    )
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--rss-limit-gb", type=float, default=3.0)
    parser.add_argument("--out", type=Path, help="also write the report here")
    args = parser.parse_args()
    limit = int(args.rss_limit_gb * GIB)
    load = os.getloadavg()[0]
    outcomes = []
    if args.before is not None:
        outcomes.append(measure(args.before.resolve(), args.timeout, limit))
    outcomes.append(measure(args.after.resolve() if args.after else None, args.timeout, limit))
    text = report(outcomes, args.timeout, args.rss_limit_gb, load)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text, encoding="utf-8")


if __name__ == "__main__":
    main()
