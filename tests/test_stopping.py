"""`layerswap serve` and `layerswap worker` stop within seconds of a SIGTERM at any moment:
during their imports even as PID 1 (a container's process without an init, run here in a PID
namespace of its own, where the kernel drops every signal its PID 1 has no handler for), and
`serve` with an event stream and a long poll open (each would hold it for minutes)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.distributed.conftest import RedisServer, free_port
from tests.helpers import wait_for
from tests.service.conftest import layer_swap

LAYERSWAP = str(Path(sys.executable).parent / "layerswap")
SIGTERM_BIT = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status's SigCgt mask
DEADLINE_S = 30.0  # a stop takes seconds; a dropped SIGTERM, forever


def environment(tmp_path: Path, **values: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update(LAYERSWAP_DATA_DIR=str(tmp_path / "data"), LAYERSWAP_PORT=str(free_port()),
               **values)  # fmt: skip
    return env


def pid_namespace() -> list[str] | None:
    """The unshare(1) command that runs a command as PID 1 of a new PID namespace (a user
    namespace too where this user may not make one alone), or None where neither works."""
    if shutil.which("unshare") is None:
        return None
    for command in (
        ["unshare", "--pid", "--fork", "--kill-child"],
        ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"],
    ):
        done = subprocess.run([*command, "sh", "-c", "echo $$"], capture_output=True, text=True)
        if done.returncode == 0 and done.stdout.strip() == "1":
            return command
    return None


def catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(int(mask, 16) & SIGTERM_BIT)


@dataclass
class Init:
    """A command run as PID 1 of a PID namespace of its own, by unshare(1), which waits for it
    and ends as it does (`status`)."""

    unshare: subprocess.Popen[bytes]
    pid: int  # the command's, as seen from here

    def status(self) -> int | None:
        return self.unshare.poll()


@contextmanager
def as_pid_1(command: list[str], env: dict[str, str]) -> Iterator[Init]:
    unshare = pid_namespace()
    if unshare is None:
        pytest.skip("no PID namespace can be made here (unshare --pid)")
    outer = subprocess.Popen([*unshare, *command], env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        found = wait_for(lambda: children(outer.pid), "the namespace's PID 1", timeout=10)
        yield Init(outer, found[0])
    finally:
        outer.kill()  # --kill-child: its PID 1 goes with it
        outer.wait(timeout=DEADLINE_S)


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in found.split()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", ["worker", "serve"])
def test_sigterm_during_start_up_ends_the_process_even_as_pid_1(
    tmp_path: Path, command: str
) -> None:
    """SIGTERM half a second after start, as soon as the process catches it: at the start of
    `main`, long before Celery or uvicorn install their own handlers after seconds of imports
    (a process that only catches it then is still stopped, but too late: it exits 0 from their
    shutdown). It ends at once, with the status SIGTERM gives anywhere else: 128 + 15."""
    env = environment(tmp_path, LAYERSWAP_BROKER_URL="redis://127.0.0.1:1/0")
    with as_pid_1([LAYERSWAP, command], env) as init:
        started = time.monotonic()
        wait_for(lambda: catches_sigterm(init.pid) or init.status() is not None,
                 f"`layerswap {command}` to catch SIGTERM", timeout=DEADLINE_S)  # fmt: skip
        time.sleep(max(0.0, started + 0.5 - time.monotonic()))
        assert init.status() is None, f"`layerswap {command}` ended by itself"
        os.kill(init.pid, signal.SIGTERM)
        wait_for(lambda: init.status() is not None, f"`layerswap {command}` to end",
                 timeout=DEADLINE_S)  # fmt: skip
        assert init.status() == 128 + signal.SIGTERM


@pytest.mark.timeout(180)
def test_serve_stops_within_seconds_with_an_event_stream_open(
    tmp_path: Path, examples: Path
) -> None:
    """A client follows a job that is not going to end (queued, no worker) with Server-Sent
    Events, a stream the API would hold for LAYERSWAP_SSE_MAX_SECONDS (15 minutes): on SIGTERM
    it is cut after LAYERSWAP_STOP_TIMEOUT_S, and the process exits."""
    for name in ("math", "swh"):
        shutil.copytree(examples / name, tmp_path / "data" / "checkpoints" / name)
    broker = RedisServer(tmp_path / "redis")
    broker.start()
    env = environment(tmp_path, LAYERSWAP_EXECUTOR="celery", LAYERSWAP_BROKER_URL=broker.url,
                      LAYERSWAP_STOP_TIMEOUT_S="1")  # fmt: skip
    log = tmp_path / "serve.log"
    with log.open("wb") as out:
        server = subprocess.Popen([LAYERSWAP, "serve"], env=env, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        url = f"http://127.0.0.1:{env['LAYERSWAP_PORT']}"
        wait_for(lambda: answers(url) or server.poll() is not None, "the API", timeout=120)
        assert server.poll() is None, log.read_text()
        job = httpx.post(f"{url}/v1/merges", json=layer_swap(), timeout=30).json()
        received: list[str] = []
        follower = threading.Thread(target=follow, args=(url, job["id"], received), daemon=True)
        follower.start()
        wait_for(lambda: any(line.startswith("event: queued") for line in received),
                 "the stream to be open", timeout=30)  # fmt: skip

        server.send_signal(signal.SIGTERM)
        wait_for(lambda: server.poll() is not None, "the API to exit", timeout=DEADLINE_S)
        follower.join(timeout=DEADLINE_S)
        assert not follower.is_alive(), "the stream ended with the process"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=DEADLINE_S)
        broker.stop()


def answers(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def follow(url: str, job_id: str, received: list[str]) -> None:
    """Read the job's event stream until the server ends it, one way or another."""
    headers = {"Accept": "text/event-stream"}
    timeout = httpx.Timeout(10.0, read=None)
    try:
        with httpx.stream("GET", f"{url}/v1/merges/{job_id}/events", headers=headers,
                          timeout=timeout) as stream:  # fmt: skip
            for line in stream.iter_lines():
                received.append(line)
    except httpx.HTTPError:
        pass  # cut: what a stop after LAYERSWAP_STOP_TIMEOUT_S does to a stream
