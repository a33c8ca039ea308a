"""The distributed deployment, for real: the API with the celery executor, a private Redis
server, PostgreSQL, and `layerswap worker` processes started (and killed) by the tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis
from sqlalchemy import create_engine, select, text

from core.db.models import Job, JobEvent
from tests import helpers
from tests.helpers import built_once
from tests.service.conftest import POSTGRES_ADMIN, Service, postgres_database, running_service

LAYERSWAP = Path(sys.executable).parent / "layerswap"
HUB_TOKEN = "hf_worker_secret_token_987654321"  # the API's and the workers' credential "team-a"
# Short enough that recovery takes seconds, long enough that a loaded machine's live worker
# (heartbeating every 0.2 s from its own thread) is never taken for dead: with the suite on
# several pytest workers (scripts/test.sh), 3 s proved too short for an evaluating worker on a
# loaded 2-core host.
# How long a step may take before a test fails: an upper bound, never a pause. On a 2-core host
# running the suite on several pytest workers beside other work, a job took over 60 s.
STEP_TIMEOUT = 180.0


def wait_for(
    condition: Callable[[], Any], what: str, timeout: float = STEP_TIMEOUT, **options: Any
) -> Any:
    """tests.helpers.wait_for with the cluster's longer bound."""
    return helpers.wait_for(condition, what, timeout, **options)


TIMINGS = {
    "heartbeat_interval_s": 0.2,
    "stale_after_s": 8.0,
    "reconcile_interval_s": 0.25,
    "progress_interval_s": 0.05,
    "db_retry_s": 30.0,
    "worker_watchdog_s": 1.0,
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private redis-server (no persistence, like the machine's own): stop() loses every
    message it held, as a real Redis restart without AOF does."""

    def __init__(self, directory: Path) -> None:
        self.directory, self.port = directory, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_connect_timeout=2, socket_timeout=5)

    def start(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.directory)],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        wait_for(self._answers, f"redis on port {self.port}", timeout=20)

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=20)
            self.process = None

    @contextmanager
    def monitor(self, log: Path) -> Iterator[Callable[[], str]]:
        """Record every command Redis executes (MONITOR, through redis-cli) into `log`; yields
        a function returning what has been recorded so far."""
        with log.open("wb") as out:
            recorder = subprocess.Popen(
                ["redis-cli", "-p", str(self.port), "monitor"], stdout=out, stderr=subprocess.STDOUT
            )
        try:
            wait_for(lambda: log.read_text().startswith("OK"), "MONITOR to start", timeout=20)
            yield lambda: log.read_text(errors="replace")
        finally:
            recorder.kill()
            recorder.wait(timeout=20)

    def _answers(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False


class PostgresServer:
    """A private PostgreSQL server (initdb into a temporary directory, trust authentication, a
    free port), for a test that restarts PostgreSQL: the machine's own server, which every
    other test uses at the same time (pytest -n), is left alone. Run as the `postgres` user
    where the suite runs as root (initdb refuses root), like the machine's server."""

    def __init__(self) -> None:
        version = sorted(p.name for p in Path("/etc/postgresql").iterdir())[-1]
        self.bin = Path("/usr/lib/postgresql") / version / "bin"
        self.port = free_port()
        # Not under pytest's temporary root: that is root's alone, and the server's user must
        # reach its directory.
        self.directory = Path(tempfile.mkdtemp(prefix="layerswap-postgres-"))
        if os.geteuid() == 0:
            shutil.chown(self.directory, "postgres", "postgres")

    @property
    def admin_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, tool: str, *args: str) -> None:
        user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        subprocess.run([*user, str(self.bin / tool), *args], check=True, timeout=120,
                       stdout=subprocess.DEVNULL)  # fmt: skip

    def _ctl(self, action: str, *args: str) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1"
        self._run("pg_ctl", action, "-D", str(self.directory / "data"), "-o", options,
                  "-l", str(self.directory / "server.log"), "-w", *args)  # fmt: skip

    def start(self) -> None:
        self._run("initdb", "-D", str(self.directory / "data"), "-U", "postgres",
                  "--auth=trust", "--no-sync")  # fmt: skip
        self._ctl("start")

    def restart(self) -> None:
        """As `pg_ctlcluster ... restart -m fast` restarts the machine's."""
        self._ctl("restart", "-m", "fast")

    def stop(self) -> None:
        self._ctl("stop", "-m", "immediate")
        shutil.rmtree(self.directory, ignore_errors=True)


class Worker:
    """A `layerswap worker` process, its output in a log file."""

    def __init__(self, name: str, env: dict[str, str], log: Path) -> None:
        self.name, self.log = name, log
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [str(LAYERSWAP), "worker", "--queues", "merge,eval", "--hostname", f"{name}@test"],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.process.poll() is None, f"worker {self.name} exited:\n{self.text()}"
            return " ready." in self.text()

        wait_for(ready, f"worker {self.name} to start", timeout=60)

    def kill(self) -> None:
        """SIGKILL: no cleanup, no acknowledgement, staging files left where they are."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=20)


@dataclass
class Cluster:
    service: Service
    redis: RedisServer
    env: dict[str, str]
    logs: Path
    workers: list[Worker] = field(default_factory=list)
    postgres: PostgresServer | None = None  # a test marked own_postgres: its private server

    def start_worker(self, name: str | None = None, **env: str) -> Worker:
        name = name or f"w{len(self.workers) + 1}"
        worker = Worker(name, {**self.env, **env}, self.logs / f"{name}.log")
        self.workers.append(worker)
        worker.wait_ready()
        return worker

    def job(self, job_id: str, kind: str = "merges") -> dict[str, Any]:
        return dict(self.service.client.get(f"/v1/{kind}/{job_id}").json())

    def wait_until(
        self, job_id: str, condition: Callable[[dict[str, Any]], bool], kind: str = "merges"
    ) -> dict[str, Any]:
        def met() -> dict[str, Any] | None:
            job = self.job(job_id, kind)
            return job if condition(job) else None

        return dict(wait_for(met, f"job {job_id}"))

    def event_types(self, job_id: str) -> list[str]:
        with self.service.db.session() as session:
            return list(
                session.scalars(
                    select(JobEvent.type).where(JobEvent.job_id == job_id).order_by(JobEvent.id)
                )
            )

    def statuses(self) -> dict[str, str]:
        with self.service.db.session() as session:
            return {job.id: job.status for job in session.scalars(select(Job))}


def worker_env(settings: Any, broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(
        LAYERSWAP_DATA_DIR=str(settings.data_dir),
        LAYERSWAP_DATABASE_URL=settings.database,
        LAYERSWAP_ALLOWED_ROOTS=json.dumps([str(p) for p in settings.allowed_roots]),
        LAYERSWAP_EXECUTOR="celery",
        LAYERSWAP_BROKER_URL=broker_url,
        LAYERSWAP_HUB_CREDENTIALS=json.dumps({"default": {"team-a": HUB_TOKEN}}),
        **{f"LAYERSWAP_{k.upper()}": str(v) for k, v in TIMINGS.items()},
    )
    for name in ("eval_data_dir", "eval_tasks_dir"):
        if getattr(settings, name) is not None:
            env[f"LAYERSWAP_{name.upper()}"] = str(getattr(settings, name))
    return env


def make_big_family(root: Path) -> None:
    import torch

    from worker.examples import make_checkpoint

    size = {"layers": 6, "hidden": 768, "intermediate": 3072, "vocab": 8192, "heads": 8}
    base = make_checkpoint(root / "base", kv_heads=4, dtype=torch.float32, **size)
    make_checkpoint(root / "math", base=base, seed=1, dtype=torch.float32)
    make_checkpoint(root / "swh", base=base, seed=2, dtype=torch.float32)


@pytest.fixture(scope="session")
def big_family(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """base/math/swh large enough (≈250 MB each, float32) that a TIES merge takes seconds:
    time for a worker to be killed, or a database restarted, in the middle of it. Written
    once per run, whatever the number of pytest-xdist workers."""
    return built_once(tmp_path_factory, "big-family", make_big_family)


@pytest.fixture
def cluster_settings() -> dict[str, Any]:
    """Settings a test module adds to the API's and the workers' (by overriding this)."""
    return {}


@contextmanager
def cluster_database(own_server: bool) -> Iterator[tuple[str, PostgresServer | None]]:
    """A fresh database on the machine's PostgreSQL, or on a private server (`own_server`:
    for a test that restarts it), and that server."""
    server = PostgresServer() if own_server else None
    try:
        if server is not None:
            server.start()
        with postgres_database(server.admin_url if server else POSTGRES_ADMIN) as url:
            # Commits without waiting for the WAL flush: the merges' own fsyncs saturate this
            # machine's disk, and a heartbeat stuck behind them would look like a dead worker.
            admin = create_engine(url, isolation_level="AUTOCOMMIT")
            with admin.connect() as connection:
                name = url.rsplit("/", 1)[1]
                connection.execute(text(f'ALTER DATABASE "{name}" SET synchronous_commit = off'))
            admin.dispose()
            yield url, server
    finally:
        if server is not None:
            server.stop()


@pytest.fixture
def cluster(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    examples: Path,
    big_family: Path,
    cluster_settings: dict[str, Any],
) -> Iterator[Cluster]:
    """API (celery executor) + private Redis + a fresh PostgreSQL database; no worker yet.
    A test marked `own_postgres` gets a PostgreSQL server of its own (cluster.postgres)."""
    server = RedisServer(tmp_path / "redis")
    server.start()
    logs = tmp_path / "logs"
    logs.mkdir()
    own = request.node.get_closest_marker("own_postgres") is not None
    try:
        with cluster_database(own) as (url, postgres):
            data = tmp_path / "data"
            extra = cluster_settings.pop("extra_roots", [])
            roots = [data / "checkpoints", data / "artifacts", big_family, *extra]
            with running_service(
                tmp_path,
                url,
                examples,
                executor="celery",
                broker_url=server.url,
                allowed_roots=roots,
                hub_credentials={"default": {"team-a": HUB_TOKEN}},
                **TIMINGS,
                **cluster_settings,
            ) as service:
                env = worker_env(service.settings, server.url)
                running = Cluster(service, server, env, logs, postgres=postgres)
                try:
                    yield running
                finally:
                    for worker in running.workers:
                        worker.kill()
    finally:
        server.stop()


def ties(family: Path, **output: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "method": "ties",
        "base": str(family / "base"),
        "models": [str(family / "math"), str(family / "swh")],
        "params": {"density": 0.3},
    }
    if output:
        body["output"] = output
    return body


def leftovers(service: Service, tenant: str = "default") -> list[str]:
    """Anything beside the outputs: staging or swapped-out directories."""
    root = service.settings.artifacts_dir / tenant
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".")) if root.is_dir() else []


def outputs(service: Service, tenant: str = "default") -> list[str]:
    root = service.settings.artifacts_dir / tenant
    return (
        sorted(p.name for p in root.iterdir() if not p.name.startswith("."))
        if root.is_dir()
        else []
    )
