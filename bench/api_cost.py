"""The API's cost per request, against a minimal FastAPI app doing the same poll on the same
store (bench/reference_app.py), and against a baseline commit's code, all in one run.

For each store (SQLite, PostgreSQL) it makes one data set: `--jobs` real layer swaps of the
example checkpoints, submitted to `layerswap serve` and run to the end, and copies of their
rows up to `--listed` jobs (the baseline's code makes it, then its store is copied for this
checkout's code, which migrates its copy). Then
these servers are measured in turn, each one `layerswap serve` process (or the reference's one
uvicorn process, with the same settings), started for its turn and stopped after it:

    reference        bench/reference_app.py on this checkout's store
    <baseline>       `layerswap serve`, the baseline commit's code (a git worktree), auth off
    <baseline> auth  the same with LAYERSWAP_AUTH=true, polled with an API key of its tenant
    current          `layerswap serve`, this checkout's code, auth off
    current auth     the same with auth on

Each round measures every one of them, in an order that rotates from round to round (so drift
on this shared machine falls on all alike):

    poll   --pollers closed-loop clients GET /v1/merges/{id} over the jobs: --warmup s, then
           --duration s measured: requests/s, and the server process's CPU per request
    list   then (the layerswap servers, auth off) one client walks GET /v1/merges?limit=50
           page by page, cursor to cursor, 1 s unmeasured then --duration s: the server's
           CPU per page. Twice: over the first pages (the --jobs merges) and back, whose
           answers a server keeps; and over the whole list (--listed jobs: the merges and
           copies of them with new ids, older), whose answers are made on every page

The figures given are the median over --rounds. Ratios: poll req/s over the reference's; auth
on over auth off (as a cost: off req/s / on req/s). The report goes to
bench/figures/api-cost-<git short sha>.md.

    .venv/bin/python bench/api_cost.py --baseline 19e014a
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import MetaData, Table, create_engine, select, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.api_load import (
    FIGURES_DIR,
    LAYERSWAP,
    REQUEST,
    ROOT,
    Process,
    _terminate,
    baseline_checkout,
    busy_percent,
    cell,
    client_collector_paused,
    free_port,
    git,
    http_ready,
    loadavg,
    machine,
    percentile,
    postgres_database,
    stat_fields,
    versions,
    wait_for,
)
from bench.lean_http import Connection, TransportError

BENCH_DIR = Path(__file__).resolve().parent
PYTHON = LAYERSWAP.parent / "python"
STORES = ("sqlite", "postgres")


@dataclass
class Server:
    name: str
    process: Process
    base_url: str
    headers: dict[str, str]
    lists: bool  # a layerswap server whose list route is measured


@dataclass
class Sample:
    requests: int = 0
    failures: int = 0
    seconds: float = 0.0
    cpu_s: float = 0.0  # the server process's, user + system
    system_s: float = 0.0  # the kernel's part (sockets, mostly)
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)  # of the failures (0: transport)

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else float("nan")

    @property
    def cpu_us(self) -> float:
        return 1e6 * self.cpu_s / self.requests if self.requests else float("nan")

    @property
    def system_us(self) -> float:
        return 1e6 * self.system_s / self.requests if self.requests else float("nan")


def base_env(code: Path | None) -> dict[str, str]:
    """The environment of a server of `code`'s service and worker packages (None: this
    checkout's), imported ahead of the editable install's finder."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env["PYTHONPATH"] = str(code or ROOT)
    return env


def layerswap(env: dict[str, str], *args: str) -> str:
    done = subprocess.run(
        [str(LAYERSWAP), *args], env=env, check=True, capture_output=True, text=True
    )
    return done.stdout.strip()


def serve(name: str, env: dict[str, str], logs: Path, **extra: str) -> Server:
    port = free_port()
    env = {**env, "LAYERSWAP_HOST": "127.0.0.1", "LAYERSWAP_PORT": str(port), **extra}
    process = Process(name, [str(LAYERSWAP), "serve"], env, logs / f"{name}.log")
    return Server(name, process, f"http://127.0.0.1:{port}", {}, lists=True)


def reference(url: str, logs: Path) -> Server:
    port = free_port()
    argv = [str(PYTHON), str(BENCH_DIR / "reference_app.py"), "--database", url,
            "--port", str(port)]  # fmt: skip
    process = Process("reference", argv, base_env(None), logs / "reference.log")
    return Server("reference", process, f"http://127.0.0.1:{port}", {}, lists=False)


def populate(env: dict[str, str], jobs: int, logs: Path) -> list[str]:
    """`jobs` layer swaps through a `layerswap serve` of `env`, run to the end: their ids."""
    server = serve("populate", env, logs)
    try:
        wait_for(lambda: server.process.alive() and http_ready(server.base_url), "serve", 90)
        with httpx.Client(base_url=server.base_url, trust_env=False, timeout=60) as http:
            ids = [http.post("/v1/merges", json=REQUEST).raise_for_status().json()["id"]
                   for _ in range(jobs)]  # fmt: skip

            def finished() -> bool:
                last = http.get(f"/v1/merges/{ids[-1]}").json()
                return bool(last["status"] in ("succeeded", "failed", "canceled"))

            wait_for(finished, "the merges", 600)
            for job_id in ids:
                status = http.get(f"/v1/merges/{job_id}").json()["status"]
                if status != "succeeded":
                    raise RuntimeError(f"job {job_id} {status}: see {logs}/populate.log")
        return ids
    finally:
        server.process.stop()


@contextlib.contextmanager
def stores(kind: str, work: Path) -> Iterator[tuple[str, str]]:
    """Two database URLs: the baseline's store (empty) and, once it is filled, its copy."""
    if kind == "sqlite":
        yield f"sqlite:///{work / 'baseline.db'}", f"sqlite:///{work / 'current.db'}"
        return
    with postgres_database() as first, postgres_database() as second:
        yield first.url, second.url


def clone_jobs(url: str, total: int) -> None:
    """Copies of the store's jobs (new ids, made a day earlier per round of copies) until it
    holds `total`: pages deep in the list, whose answers no API process keeps."""
    engine = create_engine(url)
    try:
        jobs = Table("jobs", MetaData(), autoload_with=engine)
        with engine.begin() as connection:
            originals = [dict(row._mapping) for row in connection.execute(select(jobs))]
            copies: list[dict[str, Any]] = []
            for n in range(total - len(originals)):
                row = dict(originals[n % len(originals)])
                days = 1 + n // len(originals)
                row["id"], row["idempotency_key"] = uuid.uuid4().hex, None
                row["created_at"] = row["created_at"] - timedelta(days=days)
                copies.append(row)
            for at in range(0, len(copies), 500):
                connection.execute(jobs.insert(), copies[at : at + 500])
    finally:
        engine.dispose()


def copy_store(source: str, target: str) -> None:
    if source.startswith("sqlite"):
        shutil.copyfile(source.split(":///", 1)[1], target.split(":///", 1)[1])
        return
    admin = create_engine(source.rsplit("/", 1)[0] + "/postgres", isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            old, new = source.rsplit("/", 1)[1], target.rsplit("/", 1)[1]
            connection.execute(text(f'DROP DATABASE "{new}" WITH (FORCE)'))
            connection.execute(text(f'CREATE DATABASE "{new}" TEMPLATE "{old}"'))
    finally:
        admin.dispose()


async def poll(server: Server, ids: list[str], pollers: int, warmup: float, seconds: float,
               *, pages: int = 0) -> Sample:  # fmt: skip
    """Closed loop: `pollers` clients for warmup + seconds, or with `pages` one client walking
    the list, back to the first page after that many; only what completes inside the measured
    window counts."""
    sample = Sample(seconds=seconds)
    began = time.perf_counter()
    start, end = began + warmup, began + warmup + seconds
    cpu: list[tuple[float, float]] = []

    async def client(first: int) -> None:
        async with Connection(server.base_url) as http:
            k, cursor, walked = first, "", 0
            while (now := time.perf_counter()) < end:
                if pages:
                    if walked >= pages:  # back to the first page
                        cursor, walked = "", 0
                    path = "/v1/merges?limit=50" + (f"&cursor={cursor}" if cursor else "")
                else:
                    path, k = f"/v1/merges/{ids[k % len(ids)]}", k + pollers
                try:
                    response = await http.get(path, headers=server.headers)
                    status = response.status_code
                    if pages and status == 200:
                        cursor = response.json()["next_cursor"] or ""
                        walked = walked + 1 if cursor else 0
                except TransportError:
                    status = 0
                done = time.perf_counter()
                if start <= now and done <= end:
                    sample.requests += 1
                    if status != 200:
                        sample.failures += 1
                        sample.statuses[status] += 1
                    sample.latencies_ms.append(1000 * (done - now))

    async def window() -> None:
        await asyncio.sleep(warmup)
        cpu.append(cpu_times(server.process.pid))
        await asyncio.sleep(max(0.0, end - time.perf_counter()))
        cpu.append(cpu_times(server.process.pid))

    with client_collector_paused(False):
        await asyncio.gather(window(), *(client(i) for i in range(1 if pages else pollers)))
    sample.cpu_s = sum(cpu[1]) - sum(cpu[0])
    sample.system_s = cpu[1][1] - cpu[0][1]
    return sample


def cpu_times(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of a process so far, all its threads."""
    fields = stat_fields(pid)
    if fields is None:
        raise RuntimeError(f"process {pid} is gone")
    ticks = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / ticks, int(fields[12]) / ticks


def run_loop(coroutine: Any) -> Any:
    import uvloop

    return uvloop.run(coroutine)


@dataclass
class StoreResult:
    kind: str
    jobs: int
    polls: dict[str, list[Sample]] = field(default_factory=dict)
    lists: dict[str, list[Sample]] = field(default_factory=dict)


def measure_store(kind: str, work: Path, args: argparse.Namespace, code: Path) -> StoreResult:
    logs = work / "logs"
    logs.mkdir(parents=True)
    data = work / "data"
    old_env = base_env(code)
    layerswap(old_env, "examples", str(data / "checkpoints" / "examples"))
    with stores(kind, work) as (old_url, new_url):
        envs = {}
        for name, env, url in (
            ("baseline", old_env, old_url),
            ("current", base_env(None), new_url),
        ):
            envs[name] = {**env, "LAYERSWAP_DATA_DIR": str(data), "LAYERSWAP_DATABASE_URL": url}
        print(f"[{kind}] populating: {args.jobs} merges", flush=True)
        ids = populate(envs["baseline"], args.jobs, logs)
        clone_jobs(old_url, args.listed)
        copy_store(old_url, new_url)
        layerswap(envs["current"], "db", "upgrade")
        starts: list[Callable[[], Server]] = [partial(reference, new_url, logs)]
        for name, label in (("baseline", args.baseline), ("current", "current")):
            key = layerswap(envs[name], "keys", "create", "--tenant", "default")
            starts.append(partial(serve, label, envs[name], logs))
            starts.append(partial(with_key, label, envs[name], logs, key))
        return run_rounds(kind, starts, ids, args)


def with_key(label: str, env: dict[str, str], logs: Path, key: str) -> Server:
    """`layerswap serve` with auth on, polled with `key`."""
    server = serve(f"{label} auth", env, logs, LAYERSWAP_AUTH="true")
    server.headers, server.lists = {"Authorization": f"Bearer {key}"}, False
    return server


def complaints(server: Server, lines: int = 12) -> str:
    """The end of a server's log, less its access lines: why requests failed."""
    said = [line for line in server.process.text().splitlines() if '" 200' not in line]
    return f"--- {server.name} log (last lines but 200s)\n" + "\n".join(said[-lines:])


def wait_ready(server: Server) -> None:
    wait_for(lambda: server.process.alive() and http_ready(server.base_url), server.name, 90)


def run_rounds(
    kind: str, starts: list[Callable[[], Server]], ids: list[str], args: argparse.Namespace
) -> StoreResult:
    """Each server runs only while it is measured: idle servers of the baseline's code keep up
    to 40 PostgreSQL connections each (a pool as large as their request threads), and four at
    once took the machine's PostgreSQL to its 100 connections."""
    result = StoreResult(kind, len(ids))
    for round_ in range(args.rounds):
        turn = round_ % len(starts)
        for start in starts[turn:] + starts[:turn]:
            server = start()
            try:
                wait_ready(server)
                measure(kind, round_, server, ids, args, result)
            finally:
                server.process.stop()
    return result


def measure(
    kind: str,
    round_: int,
    server: Server,
    ids: list[str],
    args: argparse.Namespace,
    result: StoreResult,
) -> None:
    sample = run_loop(poll(server, ids, args.pollers, args.warmup, args.duration))
    result.polls.setdefault(server.name, []).append(sample)
    if sample.failures:
        print(complaints(server), flush=True)
    print(
        f"[{kind}] round {round_ + 1} poll {server.name}: {sample.rps:.0f}/s, "
        f"{sample.cpu_us:.0f} µs CPU/request, failed: {dict(sample.statuses)}",
        flush=True,
    )
    if not server.lists:
        return
    for walk, pages in (("first pages", args.jobs // 50), ("whole list", args.listed)):
        sample = run_loop(poll(server, ids, 1, 1.0, args.duration, pages=pages))
        result.lists.setdefault(f"{server.name}, {walk}", []).append(sample)
        print(
            f"[{kind}] round {round_ + 1} list {server.name}, {walk}: "
            f"{sample.cpu_us / 1000:.2f} ms CPU/page ({sample.system_us / 1000:.2f} kernel), "
            f"failed: {dict(sample.statuses)}",
            flush=True,
        )


# -- report ----------------------------------------------------------------------------------
def median(samples: list[Sample], attribute: str) -> float:
    return float(statistics.median(float(getattr(s, attribute)) for s in samples))


def spread(samples: list[Sample], attribute: str, digits: int = 0) -> str:
    values = [getattr(s, attribute) for s in samples]
    return f"{cell(min(values), digits)}–{cell(max(values), digits)}"


def poll_rows(result: StoreResult, baseline: str) -> list[str]:
    polls = result.polls
    floor = median(polls["reference"], "rps")
    rows = []
    for name, samples in polls.items():
        rps = median(samples, "rps")
        p99 = percentile([v for s in samples for v in s.latencies_ms], 99)
        auth = ""
        if name.endswith(" auth"):
            off = median(polls[name.removesuffix(" auth")], "rps")
            auth = f"{off / rps:.2f}×"
        rows.append(
            f"| {result.kind} | {name} | {cell(rps, 0)} ({spread(samples, 'rps')}) | "
            f"{rps / floor:.2f}× | {auth} | {cell(median(samples, 'cpu_us'), 0)} "
            f"({cell(median(samples, 'system_us'), 0)}) | "
            f"{cell(p99)} | {sum(s.failures for s in samples)} |"
        )
    return rows


def list_rows(result: StoreResult) -> list[str]:
    rows = []
    for name, samples in result.lists.items():
        ms = [s.cpu_us / 1000 for s in samples]
        wall = statistics.median(percentile(s.latencies_ms, 50) for s in samples)
        rows.append(
            f"| {result.kind} | {name} | {statistics.median(ms):.2f} "
            f"({min(ms):.2f}–{max(ms):.2f}) | {median(samples, 'system_us') / 1000:.2f} | "
            f"{cell(wall, 2)} | {sum(s.requests for s in samples)} | "
            f"{sum(s.failures for s in samples)} |"
        )
    return rows


def markdown(results: list[StoreResult], args: argparse.Namespace, meta: dict[str, str]) -> str:
    polls = [
        "| store | server | poll req/s, median (range) | ÷ reference | auth cost (off ÷ on) "
        "| server CPU µs/request (of which kernel) | p99 ms | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    lists = [
        "| store | server | server CPU ms/page, median (range) | of which kernel | p50 ms/page "
        "| pages | failed |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        polls += poll_rows(result, args.baseline)
        lists += list_rows(result)
    return "\n".join(
        [
            "# API cost per request: layerswap against a minimal FastAPI app",
            "",
            f"layerswap at {meta['commit']} against {meta['baseline']}, {meta['date']}.",
            "",
            f"Command: `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}; the load generator (bench/lean_http.py on uvloop, one "
            "process) shares these cores with the servers. Load average before/after: "
            f"{meta['load_before']} / {meta['load_after']}; the machine was "
            f"{meta['busy_before']} % busy in the 3 s before the run. {meta['versions']}.",
            "",
            f"Each store holds {args.jobs} finished layer swaps of the example checkpoints, made "
            f"through the API, and copies of their rows up to {args.listed} jobs. Every server "
            "is one process with uvicorn's defaults "
            "(`layerswap serve`; the reference: bench/reference_app.py with the same "
            "`uvicorn.run` settings), started for its turn and stopped after it; "
            f"{args.rounds} rounds, each measuring every server in turn in a rotating order: "
            f"{args.pollers} closed-loop pollers of `GET /v1/merges/{{id}}` ({args.warmup:g} s "
            f"unmeasured, {args.duration:g} s measured), then one client walking "
            f"`GET /v1/merges?limit=50` page by page (1 s unmeasured, {args.duration:g} s), "
            f"over the first {args.jobs // 50} pages (answers kept), then over the whole list "
            f"({args.listed} jobs, the merges' rows copied with new ids: answers made anew, "
            "since a process keeps 4096). Figures: the "
            "median over the rounds (range in parentheses); CPU: the server process's user + "
            "system time over the measured window divided by the requests answered in it.",
            "",
            *polls,
            "",
            *lists,
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--store", choices=[*STORES, "both"], default="both")
    parser.add_argument("--baseline", default="19e014a", metavar="GIT_REF")
    parser.add_argument("--jobs", type=int, default=200, help="finished merges in each store")
    parser.add_argument(
        "--listed", type=int, default=6000,
        help="jobs in each store once the merges are copied (more than an API process keeps "
        "answers for: 4096)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pollers", type=int, default=64)
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds")
    parser.add_argument("--duration", type=float, default=6.0, help="measured seconds")
    parser.add_argument("--output", type=Path, help="default: bench/figures/api-cost-<sha>.md")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "service", "core/db/migrations")
    meta = {
        "commit": commit + (" (+ uncommitted changes)" if dirty else ""),
        "baseline": git("log", "-1", "--format=%h (%cs)", args.baseline),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([".venv/bin/python bench/api_cost.py", *(argv or sys.argv[1:])]),
        "machine": machine(),
        "versions": versions(),
        "load_before": loadavg(),
        "busy_before": busy_percent(3.0),
    }
    kinds = STORES if args.store == "both" else (args.store,)
    scratch = Path(tempfile.mkdtemp(prefix="layerswap-api-cost-"))
    results = []
    try:
        with baseline_checkout(args.baseline, scratch) as code:
            for kind in kinds:
                results.append(measure_store(kind, scratch / kind, args, code))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta["load_after"] = loadavg()
    report = markdown(results, args, meta)
    output = args.output or FIGURES_DIR / f"api-cost-{commit}.md"
    output.write_text(report)
    print(report)
    print(f"written to {output}")


if __name__ == "__main__":
    main()
