"""Load test of the HTTP API on loopback: submit and poll throughput and p50/p99 latency.

For each deployment, a fresh service is started from scratch in a temporary directory and torn
down afterwards (every process stopped, the data directory removed, the database dropped):

    embedded  `layerswap serve` on its default: SQLite in the data directory, the in-process
              executor (merges run on a thread of the API process)
    celery    `layerswap serve` on a fresh PostgreSQL database with the celery executor, a
              private redis-server on a free port, and one `layerswap worker` process

Both serve from one uvicorn process (what `serve` runs). Every job is a layer swap of the tiny
example checkpoints (`layerswap examples`, ~0.5 MB per model), so the merges themselves are
cheap and the API and the database are what is measured. Per deployment:

    warm-up   --warmup-submits submits, a few GETs of each, wait until they have run (this
              also pays the executor's torch import before anything is measured)
    submit    --submits POST /v1/merges from --concurrency concurrent clients (closed loop)
    drain     wait until every submitted job has finished; the time from the first submit to
              the last job's finished_at is reported (jobs start running during the submits)
    poll      --pollers concurrent pollers GET /v1/merges/{id} of the submitted (finished)
              jobs in a loop: --poll-warmup seconds unmeasured, then --duration seconds measured
    poll, If-None-Match   the same, each poller sending the ETag it last saw (304s)
    poll, open loop       each poller once every 1/--open-loop-rate s on a fixed schedule,
              latency from the scheduled time (what "200 pollers polling once a second" feel)

Latency is the client's wall time of one request (one connection per client; --client lean,
the default, is bench/lean_http.py on uvloop when installed, --client httpx is httpx on asyncio),
so it includes time queued in the client's event loop. The client runs on the same machine as
the server: on a 2-core machine they compete for the CPU, as the report says. Non-2xx answers
and transport errors are counted; a non-zero count makes the run exit with status 1 after the
report is written (bench/figures/api-<git short sha>.md).

    .venv/bin/python bench/api_load.py --deployment both

With --baseline GIT_REF, each deployment is also run on that commit's code (a git worktree of
it, imported ahead of this checkout's on the same virtual environment), just before this
checkout's, and the report opens with the two side by side: what issue 13 asks, "side by side
with today's figures in one run".

    .venv/bin/python bench/api_load.py --deployment both --baseline 7b8cab1
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import importlib.util
import math
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

import httpx
from sqlalchemy import create_engine, text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # as bench/cuda.py does
from bench.lean_http import Connection, TransportError

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
FIGURES_DIR = BENCH_DIR / "figures"
LAYERSWAP = ROOT / ".venv" / "bin" / "layerswap"
POSTGRES_ADMIN = os.environ.get(
    "LAYERSWAP_BENCH_POSTGRES", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
DEPLOYMENTS = ("embedded", "celery")
# The README's first request: a layer swap of the example checkpoints. No output.name, so the
# server names every output after its job and each submit is a new job.
REQUEST: dict[str, Any] = {
    "method": "layer_swap",
    "experts": {"task": ["examples/math"], "language": ["examples/swh"]},
    "params": {"bottom": 1, "top": 1},
}
TERMINAL = ("succeeded", "failed", "canceled")
NOT_TERMINAL = ("queued", "running", "canceling")


# -- processes -------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


class Process:
    """A child process in a session of its own, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.popen = subprocess.Popen(
                list(argv),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def tail(self, lines: int = 25) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    def alive(self) -> bool:
        """True while it runs; raises once it has exited (with the end of its log)."""
        if self.popen.poll() is not None:
            raise RuntimeError(
                f"{self.name} exited with status {self.popen.returncode}:\n{self.tail()}"
            )
        return True

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.pid)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM to the process's own group, then SIGKILL to the group if it is still there
        (the group is only signalled while its leader, our child, is not yet reaped)."""
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(timeout=timeout)


def stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the command name (state, ppid, ...); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()  # the name is in parentheses and may hold spaces


def process_cpu_seconds(pid: int | str, *, children: bool = False) -> float:
    """User + system CPU time of a process (all its threads) so far, with `children` also
    that of its children that have exited and been waited for; NaN once it is gone."""
    fields = stat_fields(pid)
    if fields is None:
        return math.nan
    ticks = [int(v) for v in fields[11:15]]
    return sum(ticks if children else ticks[:2]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """process_cpu_seconds of a process and of its live children (`serve --workers N`)."""
    total = process_cpu_seconds(pid)
    for entry in Path("/proc").glob("[0-9]*"):
        fields = stat_fields(entry.name)
        if fields is not None and int(fields[1]) == pid:  # its parent
            total += process_cpu_seconds(entry.name)
    return total


def postgres_cpu_seconds() -> float:
    """CPU time so far of every process named `postgres` on the machine and of their exited
    children: the server, its live backends, and the backends that have come and gone (the
    postmaster waits for them), which a connection pool that closes connections makes many."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != "postgres":
                continue
        except OSError:
            continue
        seconds = process_cpu_seconds(entry.name, children=True)
        total += 0.0 if math.isnan(seconds) else seconds
    return total


def redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def http_ready(base_url: str) -> bool:
    try:
        return httpx.get(f"{base_url}/readyz", timeout=2, trust_env=False).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class Postgres:
    url: str
    description: str
    sessions: Callable[[], int]  # connections opened to the database so far


@contextlib.contextmanager
def postgres_database() -> Iterator[Postgres]:
    """A fresh PostgreSQL database, dropped afterwards."""
    name = f"layerswap_bench_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_ADMIN, isolation_level="AUTOCOMMIT", pool_pre_ping=True)

    def sessions() -> int:
        # pg_stat_database.sessions (PostgreSQL 14+); statistics lag by up to a second.
        with admin.connect() as connection:
            connection.execute(text("SELECT pg_stat_clear_snapshot()"))
            found = connection.execute(
                text("SELECT sessions FROM pg_stat_database WHERE datname = :name"),
                {"name": name},
            ).scalar()
        return int(found or 0)

    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
            version = connection.execute(text("SHOW server_version")).scalar()
            sync = connection.execute(text("SHOW synchronous_commit")).scalar()
        try:
            yield Postgres(
                POSTGRES_ADMIN.rsplit("/", 1)[0] + f"/{name}",
                f"PostgreSQL {str(version).split()[0]} on this machine (synchronous_commit {sync})",
                sessions,
            )
        finally:
            with admin.connect() as connection:
                connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    finally:
        admin.dispose()


@dataclass
class Deployment:
    kind: str
    base_url: str
    api: Process
    worker: Process | None
    redis: Process | None
    postgres: Postgres | None
    description: str
    code: str = ""  # whose code it runs: "" this checkout's, else the --baseline commit's


@contextlib.contextmanager
def deployment(
    kind: str, work: Path, *, worker_nice: int = 0, code: Path | None = None, api_workers: int = 1
) -> Iterator[Deployment]:
    """Start a deployment under `work`; stop everything it started on the way out. With
    `worker_nice`, the celery worker runs at that lower CPU priority (`layerswap worker --nice`).
    With `code`, a checkout of other code (--baseline): its `service` and `worker` packages
    are imported instead of this checkout's, on this checkout's virtual environment. With
    `api_workers` > 1 (PostgreSQL only), `layerswap serve --workers N`."""
    data = work / "data"
    logs = work / "logs"
    logs.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    if code is not None:
        env["PYTHONPATH"] = str(code)  # ahead of the editable install's finder
        imported = subprocess.run(
            [str(LAYERSWAP.parent / "python"), "-c", "import service; print(service.__file__)"],
            env=env, cwd=work, check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        if not Path(imported).is_relative_to(code):
            raise RuntimeError(f"the baseline's code is not what runs: service is {imported}")
    subprocess.run(
        [str(LAYERSWAP), "examples", str(data / "checkpoints" / "examples")],
        check=True,
        stdout=subprocess.DEVNULL,
        env=env,
    )
    port = free_port()
    env.update(LAYERSWAP_DATA_DIR=str(data), LAYERSWAP_HOST="127.0.0.1", LAYERSWAP_PORT=str(port))
    base_url = f"http://127.0.0.1:{port}"
    with contextlib.ExitStack() as stack:
        redis: Process | None = None
        postgres: Postgres | None = None
        description = (
            "SQLite (WAL) in the data directory + in-process executor (one job at a time, on a "
            "thread of the API process)"
        )
        if kind == "celery":
            postgres = stack.enter_context(postgres_database())
            redis_port = free_port()
            redis_dir = work / "redis"
            redis_dir.mkdir()
            redis = started_redis = Process(
                "redis-server",
                ["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(redis_dir)],
                env, logs / "redis.log",
            )  # fmt: skip
            stack.callback(started_redis.stop)
            wait_for(lambda: started_redis.alive() and redis_answers(redis_port), "redis", 20)
            env.update(
                LAYERSWAP_DATABASE_URL=postgres.url,
                LAYERSWAP_EXECUTOR="celery",
                LAYERSWAP_BROKER_URL=f"redis://127.0.0.1:{redis_port}/0",
            )
            description = (
                f"a fresh database on {postgres.description} + celery executor, a private "
                "redis-server (no persistence), one `layerswap worker` process (solo pool: one "
                "job at a time"
                + (f"; `--nice {worker_nice}`, below the API's priority" if worker_nice else "")
                + ")"
            )
        serve = [
            str(LAYERSWAP),
            "serve",
            *(["--workers", str(api_workers)] if api_workers > 1 else []),
        ]
        api = Process("layerswap serve", serve, env, logs / "serve.log")
        stack.callback(api.stop)
        wait_for(lambda: api.alive() and http_ready(base_url), "layerswap serve", 90)
        worker = None
        if kind == "celery":
            worker = Process(
                "layerswap worker",
                [str(LAYERSWAP), "worker", *(["--nice", str(worker_nice)] if worker_nice else [])],
                env,
                logs / "worker.log",
            )
            stack.callback(worker.stop)
            started = worker
            wait_for(lambda: started.alive() and " ready." in started.text(), "worker", 90)
        yield Deployment(
            kind, base_url, api, worker, redis, postgres, description,
            code=git("rev-parse", "--short", "HEAD", cwd=code) if code is not None else "",
        )  # fmt: skip


# -- measurement -----------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def ok(status: int) -> bool:
    """2xx, or 304 (a conditional GET whose job has not changed)."""
    return 200 <= status < 300 or status == 304


@dataclass
class Phase:
    deployment: str
    name: str
    wall_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    transport_errors: Counter[str] = field(default_factory=Counter)
    cpu_s: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the phase
    warmup_failures: int = 0  # non-2xx and transport errors before the measured window
    pg_sessions: int | None = None  # PostgreSQL connections opened during the phase

    def record(self, seconds: float, status: int) -> None:
        self.latencies_ms.append(seconds * 1000)
        self.statuses[status] += 1

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + sum(self.transport_errors.values())

    @property
    def non_2xx(self) -> int:
        return sum(n for status, n in self.statuses.items() if not ok(status))

    def cpu_percent(self, process: str) -> float | None:
        seconds = self.cpu_s.get(process)
        return None if seconds is None else 100 * seconds / self.wall_s

    def summary(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "wall_s": self.wall_s,
            "rps": self.requests / self.wall_s if self.wall_s else math.nan,
            "p50_ms": percentile(self.latencies_ms, 50),
            "p99_ms": percentile(self.latencies_ms, 99),
            "max_ms": max(self.latencies_ms, default=math.nan),
            "non_2xx": self.non_2xx,
            "statuses": dict(self.statuses),
            "transport_errors": dict(self.transport_errors),
        }


def machine_busy_seconds() -> float:
    """CPU seconds spent not idle by the whole machine (all cores), from /proc/stat."""
    try:
        ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return math.nan
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    guest = sum(ticks[8:10])  # guest time is counted in user time already
    return (sum(ticks) - guest - idle) / os.sysconf("SC_CLK_TCK")


def busy_percent(seconds: float) -> str:
    """How busy the whole machine is now (all cores; 100 % = one core), over `seconds`."""
    before = machine_busy_seconds()
    time.sleep(seconds)
    return cell(100 * (machine_busy_seconds() - before) / seconds, 0)


class CpuMeter:
    """CPU seconds of this client and of the deployment's processes between start and stop."""

    def __init__(self, target: Deployment) -> None:
        self.target = target
        self._start: dict[str, float] = {}
        self._sessions = 0

    def _now(self) -> dict[str, float]:
        now = {
            "client": time.process_time(),
            "api": tree_cpu_seconds(self.target.api.pid),
            "machine": machine_busy_seconds(),
        }
        if self.target.worker is not None:
            now["worker"] = self.target.worker.cpu_seconds()
        if self.target.kind == "celery":
            redis = self.target.redis.cpu_seconds() if self.target.redis else 0.0
            now["stores"] = postgres_cpu_seconds() + redis
        return now

    def start(self) -> None:
        self._start = self._now()
        if self.target.postgres is not None:
            self._sessions = self.target.postgres.sessions()

    def stop(self, phase: Phase) -> None:
        used = {k: v - self._start[k] for k, v in self._now().items()}
        if self.target.postgres is not None:
            time.sleep(1.0)  # let the statistics catch up (not part of the phase)
            phase.pg_sessions = self.target.postgres.sessions() - self._sessions
        used["rest"] = used["machine"] - sum(v for k, v in used.items() if k != "machine")
        phase.cpu_s = used


@contextlib.contextmanager
def client_collector_paused(enabled: bool) -> Iterator[None]:
    """The measured part of a phase, with this client's garbage collector off (unless `enabled`,
    --client-gc): collected and frozen first, collected again afterwards. Every httpx request
    leaves a reference cycle (~40 objects: Response, streams, Request, URL, events), so the
    collector ran often, and its full passes stopped the event loop, and with it all the
    simulated clients at once, for 0.09-0.38 s every few seconds (gc.callbacks): an open-loop
    p99 of 120-250 ms whatever the server did (its own pauses were 10-40 ms), and idle
    server time in the closed loops. Real clients are separate processes; the garbage a phase
    leaves (~0.3 GB at 25k requests) is collected between phases."""
    gc.collect()
    gc.freeze()  # what is alive now (libraries, the clients) is walked by no pass below
    if not enabled:
        gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


LoadClient = httpx.AsyncClient | Connection
CLIENT_ERRORS = (httpx.HTTPError, TransportError)


async def load_clients(
    stack: contextlib.AsyncExitStack, base_url: str, kind: str, count: int
) -> list[LoadClient]:
    """What the simulated clients send their measured requests with, one connection each:
    bench/lean_http.py (the default; it leaves the shared cores to the server) or httpx (as
    the figures before 2026-11-24 were measured)."""
    if kind == "lean":
        return [await stack.enter_async_context(Connection(base_url)) for _ in range(count)]
    return [await stack.enter_async_context(client(base_url)) for _ in range(count)]


CLIENT_DESCRIPTION = {
    "lean": "one process, bench/lean_http.py on "
    + ("uvloop" if importlib.util.find_spec("uvloop") else "asyncio"),
    "httpx": "one asyncio process, httpx",
}


def run_loop(main: Coroutine[Any, Any, Result], client_kind: str) -> Result:
    """The lean client runs on uvloop where it is installed (less CPU per request again)."""
    if client_kind == "lean" and importlib.util.find_spec("uvloop"):
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


def client(base_url: str, connections: int = 1) -> httpx.AsyncClient:
    """One per simulated client. httpx's connection pool does work per request that grows
    with its number of connections: with one shared pool of 200 connections this client used a
    whole core (95 %) for 224 GETs/s (embedded) or 84 GETs/s (celery), and measured itself; with
    a pool per poller it uses about 25 % for more, and the API process is the bottleneck."""
    return httpx.AsyncClient(
        base_url=base_url,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        timeout=httpx.Timeout(120.0),
        trust_env=False,  # loopback: never through a proxy from the environment
    )


async def submit_phase(
    target: Deployment,
    name: str,
    submits: int,
    concurrency: int,
    *,
    client_gc: bool = False,
    client_kind: str = "lean",
) -> tuple[Phase, list[str], float]:
    """`submits` POSTs from `concurrency` closed-loop clients: (phase, job ids, start epoch)."""
    phase = Phase(target.kind, name)
    ids: list[str] = []
    todo = iter(range(submits))

    async def one_client(http: LoadClient) -> None:
        for _ in todo:  # shared by all clients: each takes the next submit
            began = time.perf_counter()
            try:
                if isinstance(http, Connection):
                    response: httpx.Response | Any = await http.post("/v1/merges", REQUEST)
                else:
                    response = await http.post("/v1/merges", json=REQUEST)
            except CLIENT_ERRORS as e:
                phase.transport_errors[type(e).__name__] += 1
                continue
            phase.record(time.perf_counter() - began, response.status_code)
            if response.status_code == 202:
                ids.append(str(response.json()["id"]))

    meter = CpuMeter(target)
    async with contextlib.AsyncExitStack() as stack:
        clients = await load_clients(stack, target.base_url, client_kind, concurrency)
        for http in clients:  # connect before the clock starts
            answer = await http.get("/healthz")
            if answer.status_code != 200:
                raise RuntimeError(f"/healthz answered {answer.status_code}")
        with client_collector_paused(client_gc):
            started_epoch = time.time()
            began = time.perf_counter()
            meter.start()
            await asyncio.gather(*(one_client(http) for http in clients))
            phase.wall_s = time.perf_counter() - began
            meter.stop(phase)
    return phase, ids, started_epoch


async def poll_phase(
    target: Deployment,
    ids: Sequence[str],
    pollers: int,
    warmup_s: float,
    duration_s: float,
    *,
    name: str = "poll",
    conditional: bool = False,
    rate: float = 0.0,
    client_gc: bool = False,
    client_kind: str = "lean",
) -> Phase:
    """Pollers over `ids`; only requests that complete inside the measured window count (those
    in flight at its end are awaited and dropped). Closed loop (`rate` 0: the next request as
    soon as the answer came), or open loop (`rate` requests per second per poller, on a fixed
    schedule; latency counts from the scheduled time, so queueing is not hidden). With
    `conditional`, each poller sends If-None-Match with the ETag it last saw for the job."""
    phase = Phase(target.kind, name)
    warmup = Phase(target.kind, f"{name} warm-up")
    meter = CpuMeter(target)
    # Set once the clients exist (below): making 200 of them takes seconds (an SSL context
    # each), which an open-loop schedule started before would count as server latency.
    began = window_start = window_end = 0.0

    async def poller(http: LoadClient, first: int) -> None:
        k = first
        etags: dict[str, str] = {}
        scheduled = began + (first % max(pollers, 1)) / max(pollers * rate, 1e-9) if rate else 0.0
        while time.perf_counter() < window_end:
            job_id = ids[k % len(ids)]
            k += pollers
            if rate:
                await asyncio.sleep(max(0.0, scheduled - time.perf_counter()))
                sent = scheduled
                scheduled += 1.0 / rate
            else:
                sent = time.perf_counter()
            headers = {"If-None-Match": etags[job_id]} if conditional and job_id in etags else {}
            status: int | None = None
            error = ""
            try:
                response = await http.get(f"/v1/merges/{job_id}", headers=headers)
                status = response.status_code
                if "etag" in response.headers:
                    etags[job_id] = response.headers["etag"]
            except CLIENT_ERRORS as e:
                error = type(e).__name__
            done = time.perf_counter()
            into = phase if window_start <= done <= window_end else warmup
            if done > window_end:
                continue
            if status is None:
                into.transport_errors[error] += 1
            else:
                into.record(done - sent, status)

    async def window() -> None:
        await asyncio.sleep(max(0.0, window_start - time.perf_counter()))
        meter.start()
        await asyncio.sleep(max(0.0, window_end - time.perf_counter()))
        meter.stop(phase)

    async with contextlib.AsyncExitStack() as stack:
        clients = await load_clients(stack, target.base_url, client_kind, pollers)
        with client_collector_paused(client_gc):
            began = time.perf_counter()
            window_start, window_end = began + warmup_s, began + warmup_s + duration_s
            await asyncio.gather(window(), *(poller(http, i) for i, http in enumerate(clients)))
    phase.wall_s = duration_s
    phase.warmup_failures = warmup.non_2xx + sum(warmup.transport_errors.values())
    return phase


def job_counts(metrics: str) -> dict[str, int]:
    """Merge jobs by status, from /metrics."""
    counts: dict[str, int] = {}
    for line in metrics.splitlines():
        if line.startswith('layerswap_jobs{kind="merge",status="'):
            status = line.split('status="', 1)[1].split('"', 1)[0]
            counts[status] = int(float(line.rsplit(" ", 1)[1]))
    return counts


async def wait_drained(target: Deployment, expected: int, timeout: float) -> bool:
    """Until /metrics shows `expected` finished merges and none queued or running."""
    deadline = time.monotonic() + timeout
    async with client(target.base_url, 1) as http:
        while time.monotonic() < deadline:
            target.api.alive()
            if target.worker is not None:
                target.worker.alive()
            response = await http.get("/metrics")
            if response.status_code == 200:
                counts = job_counts(response.text)
                finished = sum(counts.get(s, 0) for s in TERMINAL)
                if finished >= expected and not any(counts.get(s) for s in NOT_TERMINAL):
                    return True
            await asyncio.sleep(0.25)
    return False


@dataclass
class Drain:
    jobs: int
    drained: bool
    statuses: dict[str, int]
    last_finished_s: float | None  # from the first submit to the last finished_at


async def drain_report(target: Deployment, ids: Sequence[str], started_epoch: float) -> Drain:
    """Every job's status and finished_at (16 concurrent GETs; not part of any measurement)."""
    statuses: Counter[str] = Counter()
    finished: list[float] = []
    todo = iter(ids)

    async def reader(http: httpx.AsyncClient) -> None:
        for job_id in todo:
            job = (await http.get(f"/v1/merges/{job_id}")).raise_for_status().json()
            statuses[str(job["status"])] += 1
            if job.get("finished_at"):
                when = datetime.fromisoformat(str(job["finished_at"]).replace("Z", "+00:00"))
                finished.append(when.timestamp())

    async with client(target.base_url, 16) as http:
        await asyncio.gather(*(reader(http) for _ in range(16)))
    done = len(finished) == len(ids) and all(s in TERMINAL for s in statuses)
    last = max(finished) - started_epoch if finished else None
    return Drain(len(ids), done, dict(statuses), last)


@dataclass
class Result:
    deployment: Deployment
    submit: Phase
    poll: Phase | None  # None with --submit-only
    drain: Drain
    warmup_submits: int
    conditional: Phase | None = None  # closed loop, If-None-Match (304s)
    open_loop: Phase | None = None  # each poller once a second


async def run_deployment(target: Deployment, args: argparse.Namespace) -> Result:
    tag = target.kind + (f" @ {target.code}" if target.code else "")

    def say(line: str, *, flush: bool) -> None:
        print(line.replace(f"[{target.kind}]", f"[{tag}]", 1), flush=flush)

    say(f"[{target.kind}] {target.description}; API at {target.base_url}", flush=True)
    warm, warm_ids, _ = await submit_phase(
        target, "submit warm-up", args.warmup_submits, args.concurrency,
        client_gc=args.client_gc, client_kind=args.client,
    )  # fmt: skip
    if warm.non_2xx or warm.transport_errors:
        raise RuntimeError(f"warm-up submits failed: {warm.summary()}")
    async with client(target.base_url, 8) as http:
        for _ in range(3):
            await asyncio.gather(*(http.get(f"/v1/merges/{j}") for j in warm_ids))
    if not await wait_drained(target, len(warm_ids), args.drain_timeout):
        raise RuntimeError("the warm-up jobs did not finish")
    say(f"[{target.kind}] warm-up done ({len(warm_ids)} jobs ran)", flush=True)

    submit, ids, started_epoch = await submit_phase(
        target,
        "submit",
        args.submits,
        args.concurrency,
        client_gc=args.client_gc,
        client_kind=args.client,
    )
    say(f"[{target.kind}] submit: {fmt_summary(submit)}", flush=True)
    if not ids:
        raise RuntimeError(f"no submit succeeded: {submit.summary()}")
    if args.submit_only:  # the merges are left running: what they cost is not measured here
        drain = await drain_report(target, ids, started_epoch)
        say(f"[{target.kind}] after the submits: {drain}", flush=True)
        return Result(target, submit, None, drain, len(warm_ids))
    drained = await wait_drained(target, len(warm_ids) + len(ids), args.drain_timeout)
    drain = await drain_report(target, ids, started_epoch)
    drain.drained = drain.drained and drained
    say(f"[{target.kind}] drain: {drain}", flush=True)

    poll = await poll_phase(
        target,
        ids,
        args.pollers,
        args.poll_warmup,
        args.duration,
        client_gc=args.client_gc,
        client_kind=args.client,
    )
    say(f"[{target.kind}] poll: {fmt_summary(poll)}", flush=True)
    conditional = await poll_phase(
        target, ids, args.pollers, args.poll_warmup, args.duration,
        name="poll, If-None-Match", conditional=True, client_gc=args.client_gc,
        client_kind=args.client,
    )  # fmt: skip
    say(f"[{target.kind}] conditional poll: {fmt_summary(conditional)}", flush=True)
    open_loop = await poll_phase(
        target, ids, args.pollers, args.poll_warmup, args.duration,
        name="poll, open loop", rate=args.open_loop_rate, client_gc=args.client_gc,
        client_kind=args.client,
    )  # fmt: skip
    say(f"[{target.kind}] open-loop poll: {fmt_summary(open_loop)}", flush=True)
    return Result(target, submit, poll, drain, len(warm_ids), conditional, open_loop)


def fmt_summary(phase: Phase) -> str:
    s = phase.summary()
    return (
        f"{s['requests']} requests, {s['rps']:.1f}/s, p50 {s['p50_ms']:.1f} ms, "
        f"p99 {s['p99_ms']:.1f} ms, non-2xx {s['non_2xx']}, errors {s['transport_errors']}"
    )


# -- report ----------------------------------------------------------------------------------
def git(*args: str, cwd: Path = ROOT) -> str:
    done = subprocess.run(["git", "-C", str(cwd), *args], capture_output=True, text=True)
    return done.stdout.strip()


@contextlib.contextmanager
def baseline_checkout(ref: str, scratch: Path) -> Iterator[Path]:
    """`ref`'s code in a git worktree under `scratch`, removed afterwards."""
    path = scratch / "baseline-code"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), ref],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        yield path
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                       capture_output=True)  # fmt: skip


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def machine() -> str:
    mem = next(
        (line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
         if line.startswith("MemTotal")), "0",
    )  # fmt: skip
    gpu = "an NVIDIA GPU (nvidia-smi present)" if shutil.which("nvidia-smi") else "no GPU"
    return (
        f"{os.cpu_count()} CPU cores, {int(mem) * 1024 / 1e9:.1f} GB RAM, {gpu}, kernel "
        f"{platform.release()}, Python {platform.python_version()}"
    )


def versions() -> str:
    import importlib.metadata as md

    names = ("uvicorn", "fastapi", "httpx", "sqlalchemy", "celery")
    found = []
    for name in names:
        try:
            found.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            continue
    for extra in ("uvloop", "httptools"):
        try:
            md.version(extra)
            found.append(f"{extra} installed")
        except md.PackageNotFoundError:
            found.append(f"no {extra}")
    return ", ".join(found)


def cell(value: float | None, digits: int = 1) -> str:
    if value is None or math.isnan(value):
        return "—"
    shown = f"{value:.{digits}f}"
    return shown.removeprefix("-") if float(shown) == 0 else shown  # never "-0"


def named(r: Result) -> str:
    """The deployment, and whose code ran it when a baseline ran too."""
    return r.deployment.kind + (f" @ {r.deployment.code}" if r.deployment.code else "")


def side_by_side(results: list[Result], args: argparse.Namespace, commit: str) -> list[str]:
    """Per deployment and phase: the baseline's figures, this checkout's, and their ratio."""
    rows = [
        f"| deployment | phase | {args.baseline} req/s (p99 ms) | {commit} req/s (p99 ms) "
        "| req/s ratio |",
        "|---|---|---:|---:|---:|",
    ]
    for kind in DEPLOYMENTS:
        runs = {bool(r.deployment.code): r for r in results if r.deployment.kind == kind}
        if len(runs) < 2:
            continue
        old, new = runs[True], runs[False]
        for label, attribute in PHASES:
            before, after = getattr(old, attribute), getattr(new, attribute)
            if before is None or after is None:
                continue
            b, a = before.summary(), after.summary()
            ratio = a["rps"] / b["rps"] if b["rps"] else math.nan
            rows.append(
                f"| {kind} | {label} | {cell(b['rps'])} ({cell(b['p99_ms'])}) | "
                f"{cell(a['rps'])} ({cell(a['p99_ms'])}) | {ratio:.2f}× |"
            )
    return rows


PHASES = (
    ("submit", "submit"),
    ("poll", "poll"),
    ("poll with If-None-Match", "conditional"),
    ("open-loop poll", "open_loop"),
)


def markdown(results: list[Result], args: argparse.Namespace, meta: dict[str, str]) -> str:
    rows = [
        "| deployment | phase | requests | req/s | p50 ms | p99 ms | max ms | non-2xx | "
        "transport errors | API CPU % | worker CPU % | client CPU % | PostgreSQL + Redis "
        "CPU % | rest of machine CPU % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        phases: list[tuple[Phase | None, str]] = [
            (r.submit, f"submit (POST, {args.concurrency} clients)"),
            (r.poll, f"poll (GET, {args.pollers} pollers, {args.duration:g} s)"),
            (r.conditional, f"poll with If-None-Match ({args.pollers} pollers; 304s)"),
            (
                r.open_loop,
                f"open-loop poll ({args.pollers} pollers × {args.open_loop_rate:g}/s)",
            ),
        ]
        for phase, label in phases:
            if phase is None:
                continue
            s = phase.summary()
            rows.append(
                f"| {named(r)} | {label} | {s['requests']} | {cell(s['rps'])} | "
                f"{cell(s['p50_ms'])} | {cell(s['p99_ms'])} | {cell(s['max_ms'])} | "
                f"{s['non_2xx']} | {sum(s['transport_errors'].values())} | "
                f"{cell(phase.cpu_percent('api'), 0)} | {cell(phase.cpu_percent('worker'), 0)} | "
                f"{cell(phase.cpu_percent('client'), 0)} | "
                f"{cell(phase.cpu_percent('stores'), 0)} | {cell(phase.cpu_percent('rest'), 0)} |"
            )
    drain_rows = [
        "| deployment | merges submitted | all finished | last finished, s after first submit "
        "| merges/s | statuses |",
        "|---|---:|---|---:|---:|---|",
    ]
    for r in results:
        d = r.drain
        rate = d.jobs / d.last_finished_s if d.last_finished_s else None
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(d.statuses.items()))
        drain_rows.append(
            f"| {named(r)} | {d.jobs} | {'yes' if d.drained else '**no**'} | "
            f"{cell(d.last_finished_s)} | {cell(rate)} | {statuses} |"
        )
    connections = [
        f"- {named(r)}: {r.submit.pg_sessions} during the submits"
        + (f", {r.poll.pg_sessions} during the measured polls" if r.poll else "")
        for r in results
        if r.submit.pg_sessions is not None
    ]
    notes = []
    for r in results:
        polled = r.poll or Phase(r.deployment.kind, "poll")
        extra = [f"{k}: {v}" for k, v in (r.submit.statuses | polled.statuses).items() if k >= 300]
        errors = r.submit.transport_errors + polled.transport_errors
        extra += [f"{k}: {v}" for k, v in errors.items()]
        if r.poll and r.poll.warmup_failures:
            extra.append(f"{r.poll.warmup_failures} failed requests during the poll warm-up")
        if extra:
            notes.append(f"- {named(r)}: {'; '.join(extra)}")
    collector = (
        "**on** while measuring (`--client-gc`), so its pauses count as latency. "
        if args.client_gc
        else "off while measuring (collected between phases; `--client-gc` keeps it on), "
        "since its full passes stopped all the simulated clients at once. "
    )
    deployments = "\n".join(
        f"- **{r.deployment.kind}**: {r.deployment.description}"
        for r in results
        if not r.deployment.code
    )
    baseline = (
        [
            f"**Side by side with {args.baseline}** ({meta['baseline']}), run in the same "
            "command: its `service` and `worker` from a git worktree, on this checkout's "
            "virtual environment and load generator; for each deployment the baseline ran "
            "first, then this checkout.",
            "",
            *side_by_side(results, args, meta["commit"].split()[0]),
            "",
        ]
        if args.baseline
        else []
    )
    return "\n".join(
        [
            "# API load: submit and poll on loopback",
            "",
            f"layerswap at {meta['commit']}, {meta['date']}.",
            "",
            f"Command: `{meta['command']}`",
            "",
            f"Machine: {meta['machine']}. **The load generator ({meta['client']}) and "
            "the service share these cores**, so the client's CPU use is taken from the "
            "server's; figures are a lower bound on what the service does for remote clients. "
            f"Load average before/after: {meta['load_before']} / {meta['load_after']}. "
            f"{meta['versions']}.",
            "",
            "Deployments (each started fresh in a temporary directory; one uvicorn process "
            "unless said otherwise, "
            "`layerswap serve`):",
            "",
            deployments,
            "",
            f"Parameters: {args.warmup_submits} warm-up submits from {args.concurrency} "
            f"clients (run to completion, not measured); then {args.submits} submits "
            "(`POST /v1/merges`, a layer swap of the "
            f"example checkpoints, each a new job) from {args.concurrency} concurrent "
            f"closed-loop clients; then, once they have all run, {args.pollers} concurrent "
            f"pollers `GET /v1/merges/{{id}}` over those jobs, {args.poll_warmup:g} s "
            f"unmeasured then {args.duration:g} s measured (requests completed in the window). "
            "Latency: client-side wall time per request, including time queued in the "
            "client's event loop; the client's garbage collector was "
            + collector
            + "CPU %: CPU seconds of the process over the phase's wall time "
            "(100 % = one core); PostgreSQL + Redis: every `postgres` process on the machine "
            "and the private redis-server (celery only); rest of machine: the machine's busy "
            "CPU time (all cores, /proc/stat) minus all the columns before it: the kernel "
            "(loopback TCP, writing back the merges' fsynced files) and anything else running; "
            f"the whole machine was {meta['busy_before']} % busy in the 3 s before the run. "
            "In a closed loop "
            "latency ≈ clients / throughput, so once the API process is saturated the p50 "
            "is mostly time waiting in its queue.",
            "",
            *baseline,
            *rows,
            "",
            (
                "The merges when the submits ended (`--submit-only`: they were not waited for):"
                if args.submit_only
                else "Executor drain (the merges start running while the submits go on; the "
                "last job's `finished_at`, from the server, against the client's clock at the "
                "first submit):"
            ),
            "",
            *drain_rows,
            "",
            *(
                [
                    "PostgreSQL connections opened to the database (`pg_stat_database.sessions`; "
                    "a steady connection pool would open none):",
                    "",
                    *connections,
                    "",
                ]
                if connections
                else []
            ),
            *(["Non-2xx answers and transport errors:", "", *notes, ""] if notes else []),
        ]
    )


# -- main ------------------------------------------------------------------------------------
def run_one(kind: str, work: Path, args: argparse.Namespace, code: Path | None) -> Result:
    try:
        api_workers = args.api_workers if kind == "celery" else 1  # SQLite: one process
        with deployment(
            kind, work, worker_nice=args.worker_nice, code=code, api_workers=api_workers
        ) as target:
            return run_loop(run_deployment(target, args), args.client)
    except Exception:
        for log in sorted((work / "logs").glob("*.log")):
            lines = log.read_text(errors="replace").splitlines()[-30:]
            print(f"--- {log.name} (last lines)\n" + "\n".join(lines), file=sys.stderr)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)  # ~0.5 MB per merge written


def _terminate(signum: int, _frame: FrameType | None) -> NoReturn:
    raise SystemExit(128 + signum)  # so the finally blocks stop what was started


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--deployment", choices=[*DEPLOYMENTS, "both"], default="both")
    parser.add_argument(
        "--submits", type=int, default=2000,
        help="measured submits (500 before 2026-11-24: under a second at today's rates)",
    )  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=32, help="concurrent submit clients")
    parser.add_argument("--pollers", type=int, default=200)
    parser.add_argument("--duration", type=float, default=20.0, help="measured poll seconds")
    parser.add_argument("--poll-warmup", type=float, default=3.0, help="unmeasured poll seconds")
    parser.add_argument(
        "--warmup-submits", type=int, default=64,
        help="unmeasured submits first, from as many clients as the measured ones, so the "
        "API's request threads and pooled connections exist before the clock starts (16 "
        "from 8 clients before 2026-11-24)",
    )  # fmt: skip
    parser.add_argument(
        "--open-loop-rate", type=float, default=1.0, help="requests/s per poller, open loop"
    )
    parser.add_argument(
        "--drain-timeout", type=float, default=240.0, help="most seconds to wait for the merges"
    )
    parser.add_argument(
        "--client-gc", action="store_true",
        help="keep the load generator's garbage collector on while measuring (its pauses then "
        "count as latency)",
    )  # fmt: skip
    parser.add_argument(
        "--client", choices=("lean", "httpx"), default="lean",
        help="what the simulated clients send measured requests with: bench/lean_http.py "
        "(default; it leaves the shared cores to the server) or httpx (the figures before "
        "2026-11-24)",
    )  # fmt: skip
    parser.add_argument(
        "--worker-nice", type=int, default=0, choices=range(20), metavar="0-19",
        help="run the celery worker at this lower CPU priority (`layerswap worker --nice`), as "
        "an operator would on a host shared with the API; default 0: the same priority",
    )  # fmt: skip
    parser.add_argument(
        "--api-workers", type=int, default=1, metavar="N",
        help="API processes of the celery deployment (`layerswap serve --workers N`); the "
        "embedded one always runs one (SQLite has one writer)",
    )  # fmt: skip
    parser.add_argument(
        "--baseline", metavar="GIT_REF",
        help="also run the deployments on this commit's code (a git worktree), each just "
        "before this checkout's, and report the two side by side",
    )  # fmt: skip
    parser.add_argument(
        "--submit-only", action="store_true",
        help="measure the warm-up and the submits only: no drain (the merges are left to run "
        "while the deployment is stopped) and no polls",
    )  # fmt: skip
    parser.add_argument("--output", type=Path, help="default: bench/figures/api-<git short sha>.md")
    args = parser.parse_args(argv)
    for name in ("submits", "concurrency", "pollers", "warmup_submits", "api_workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if not LAYERSWAP.exists():
        sys.exit(f"{LAYERSWAP} is missing (bash scripts/setup.sh)")
    if args.deployment != "embedded" and not shutil.which("redis-server"):
        sys.exit("redis-server is not installed (needed by the celery deployment)")
    kinds = DEPLOYMENTS if args.deployment == "both" else (args.deployment,)
    cli_args = argv if argv is not None else sys.argv[1:]
    signal.signal(signal.SIGTERM, _terminate)

    commit = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "worker", "service", "core/db/migrations")
    meta = {
        "commit": commit + (" (+ uncommitted changes in worker/, service/ or core/db/migrations/)"
                            if dirty else ""),
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": " ".join([".venv/bin/python bench/api_load.py", *cli_args]),
        "machine": machine(),
        "versions": versions(),
        "load_before": loadavg(),
        "busy_before": busy_percent(3.0),
        "client": CLIENT_DESCRIPTION[args.client],
    }  # fmt: skip
    results: list[Result] = []
    scratch = Path(tempfile.mkdtemp(prefix="layerswap-api-bench-"))
    try:
        with contextlib.ExitStack() as stack:
            codes: list[Path | None] = [None]
            if args.baseline:
                codes.insert(0, stack.enter_context(baseline_checkout(args.baseline, scratch)))
                meta["baseline"] = git("log", "-1", "--format=%h, %cs: %s", args.baseline)
            for kind in kinds:
                for code in codes:
                    results.append(run_one(kind, scratch / kind, args, code))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta["load_after"] = loadavg()

    report = markdown(results, args, meta)
    output = args.output or FIGURES_DIR / f"api-{commit or 'unknown'}.md"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(report)
    print()
    print(report)
    print(f"written to {output}")
    bad = sum(
        phase.non_2xx + sum(phase.transport_errors.values())
        for r in results for phase in (r.submit, r.poll) if phase is not None
    )  # fmt: skip
    if bad:
        sys.exit(f"{bad} requests failed (non-2xx or transport errors): see the report")


if __name__ == "__main__":
    main()
