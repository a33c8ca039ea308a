"""Slow clients against the real server (`layerswap serve` in a subprocess, on loopback): a
request head or body that trickles or stalls is cut off (408, the connection closed) while
other clients are served, also in every process of `--workers`; a process holds a bounded
number of connections; X-Forwarded-For and X-Forwarded-Proto are believed only from a proxy
LAYERSWAP_FORWARDED_ALLOW_IPS names. Every loop here is bounded in count and in time."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.connections import OTHER_FILES
from tests.distributed.conftest import free_port
from tests.helpers import healthy, wait_for
from tests.service.conftest import postgres_database

LAYERSWAP = str(Path(sys.executable).parent / "layerswap")
DEADLINE_S = "2"  # the servers' header and body timeouts
SLOW = 100  # slow clients at once: far under any limit on open files
TRICKLE_S = 0.7  # between two pieces a trickling client sends
HEAD = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # a request head, less its last line
BODY_HEAD = (
    b"POST /v1/merges HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
    b"Content-Length: 100000\r\n\r\n{"
)  # and then the body does not come, or a byte at a time


@dataclass
class Server:
    port: int
    log: Path
    pid: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logged(self, text: str) -> str | None:
        """The server's log line that holds `text`, once written."""
        return next((line for line in self.log.read_text().splitlines() if text in line), None)


def open_files_limits(soft: int | None, hard: int | None) -> Callable[[], None] | None:
    """What starts a process with these open-files limits (None: as this process's)."""
    if soft is None and hard is None:
        return None
    ours = resource.getrlimit(resource.RLIMIT_NOFILE)
    limits = (soft or ours[0], hard or ours[1])
    return lambda: resource.setrlimit(resource.RLIMIT_NOFILE, limits)


@contextmanager
def layerswap_serve(
    root: Path,
    *args: str,
    open_files: tuple[int | None, int | None] = (None, None),
    **settings: str,
) -> Iterator[Server]:
    """`layerswap serve ARGS` on a free loopback port, with 2 s deadlines unless `settings`
    (LAYERSWAP_* variables) say otherwise, started with `open_files` as its soft and hard
    open-files limits where given; its output in root/serve.log."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("LAYERSWAP_")}
    env.update({"LAYERSWAP_DATA_DIR": str(root / "data"), "LAYERSWAP_PORT": str(port),
                "LAYERSWAP_HEADER_TIMEOUT_S": DEADLINE_S, "LAYERSWAP_BODY_TIMEOUT_S": DEADLINE_S,
                **settings})  # fmt: skip
    log = root / "serve.log"
    with log.open("w") as out:
        process = subprocess.Popen([LAYERSWAP, "serve", *args], env=env, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True,
                                   preexec_fn=open_files_limits(*open_files))  # fmt: skip
    server = Server(port, log, process.pid)
    try:
        wait_for(lambda: healthy(server.url) or process.poll() is not None, "the API", 180)
        assert process.poll() is None, log.read_text()
        yield server
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with layerswap_serve(tmp_path_factory.mktemp("serve")) as running:
        yield running


def opened(server: Server, count: int, first: bytes) -> list[socket.socket]:
    """`count` connections, each having sent `first`; non-blocking from then on."""
    clients = []
    for _ in range(count):
        client = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        client.sendall(first)
        client.setblocking(False)
        clients.append(client)
    return clients


def read(client: socket.socket) -> bytes | None:
    """What arrived: b"" once the server closed (or reset) the connection, None for nothing."""
    try:
        return client.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""


def held_until_closed(pieces: dict[socket.socket, bytes], timeout: float = 60) -> list[bytes]:
    """Each client sends its piece (b"": nothing) every TRICKLE_S until the server closes it;
    what the server sent each, in order. Fails unless the server closes them all in `timeout`."""
    received = {client: bytearray() for client in pieces}
    waiting = set(pieces)
    due = [time.monotonic() + TRICKLE_S]

    def all_closed() -> bool:
        if time.monotonic() >= due[0]:
            due[0] += TRICKLE_S
            for client in waiting:
                with suppress(OSError):  # closed by the server: read() says so
                    client.send(pieces[client])
        for client in list(waiting):
            data = read(client)
            if data is not None:
                received[client] += data
                if not data:
                    waiting.discard(client)
        return not waiting

    try:
        wait_for(all_closed, lambda: f"the server to close {len(waiting)} slow clients", timeout,
                 interval=0.05)  # fmt: skip
    finally:
        for client in pieces:
            client.close()
    return [bytes(received[client]) for client in pieces]


def error_of(raw: bytes, status: int) -> dict[str, Any]:
    """The error of the last answer in `raw` (several on a kept-alive connection)."""
    head, _, body = raw[raw.rindex(b"HTTP/1.1 ") :].partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), raw[:300]
    assert b"content-type: application/json" in head.lower(), head
    return dict(json.loads(body)["error"])


# --- slow clients ---------------------------------------------------------------------------


def test_clients_that_trickle_or_stall_their_head_are_cut_off(server: Server) -> None:
    trickling = opened(server, SLOW, HEAD)
    stalled = opened(server, 5, HEAD) + opened(server, 5, b"")  # part of a head; nothing
    # On a kept-alive connection: one request answered, then the next one's head stalls.
    kept_alive = opened(server, 1, HEAD + b"\r\n" + HEAD)
    # Meanwhile a client that sends its request whole is answered.
    assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
    pieces = {client: b"X-Trickle: 1\r\n" for client in trickling}
    pieces |= {client: b"" for client in stalled + kept_alive}
    answers = held_until_closed(pieces)
    for raw in answers[SLOW:]:  # stalled: nothing they sent is left unread, no reset
        error = error_of(raw, 408)
        assert error["code"] == "request_timeout", error
        assert error["details"] == {"field": "headers", "limit_s": 2}, error
    assert answers[-1].startswith(b"HTTP/1.1 200 "), answers[-1][:200]
    # The trickling ones got the same 408, unless a piece they sent as the server closed
    # reset the connection first; none got anything else.
    assert any(raw.startswith(b"HTTP/1.1 408 ") for raw in answers[:SLOW])
    assert all(raw.startswith(b"HTTP/1.1 408 ") for raw in answers[:SLOW] if raw)
    assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200


def test_request_bodies_that_stall_or_trickle_are_cut_off(server: Server) -> None:
    stalled = opened(server, SLOW // 2, BODY_HEAD)
    trickling = opened(server, SLOW // 2, BODY_HEAD)  # a byte every TRICKLE_S
    assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200
    pieces = {client: b"" for client in stalled} | {client: b" " for client in trickling}
    answers = held_until_closed(pieces)
    for raw in answers[: len(stalled)]:
        error = error_of(raw, 408)
        assert error["code"] == "request_timeout", error
        assert error["details"] == {"field": "body", "limit_s": 2}, error
    assert all(raw.startswith(b"HTTP/1.1 408 ") for raw in answers[len(stalled) :] if raw)
    # Nothing was submitted, and the server goes on answering.
    jobs = httpx.get(f"{server.url}/v1/merges", timeout=30)
    assert jobs.status_code == 200 and jobs.json()["items"] == [], jobs.text


def open_files_limit(pid: int) -> int:
    """The soft open-files limit of process `pid`."""
    limits = Path(f"/proc/{pid}/limits").read_text().splitlines()
    return int(next(line for line in limits if line.startswith("Max open files")).split()[3])


def test_a_process_holds_at_most_max_connections(tmp_path: Path) -> None:
    """Started with 256 open files allowed, it raises its own limit to hold its connections
    and what it opens beside them; a connection past them is refused."""
    with layerswap_serve(tmp_path, open_files=(256, None), LAYERSWAP_MAX_CONNECTIONS="10",
                         LAYERSWAP_HEADER_TIMEOUT_S="120") as server:  # fmt: skip
        assert open_files_limit(server.pid) == 10 + OTHER_FILES
        assert "warning" not in server.log.read_text()
        held = opened(server, 10, b"")
        [raw] = held_until_closed({opened(server, 1, b"")[0]: b""}, timeout=30)
        error = error_of(raw, 503)
        assert error["code"] == "too_many_connections", error
        assert error["details"] == {"limit": 10}, error
        for client in held:
            client.close()
        wait_for(lambda: healthy(server.url), "the server to take connections again", 30)


def test_an_open_files_limit_it_cannot_raise_is_said_at_start(tmp_path: Path) -> None:
    with layerswap_serve(tmp_path, open_files=(256, 256)) as server:
        assert open_files_limit(server.pid) == 256
        warning = server.logged("layerswap: warning:")
        assert warning and "1000 connections (LAYERSWAP_MAX_CONNECTIONS)" in warning, warning
        assert f"need {1000 + OTHER_FILES}" in warning, warning


# --- proxy headers --------------------------------------------------------------------------

FORWARDED = {"X-Forwarded-For": "203.0.113.9", "X-Forwarded-Proto": "https"}


def forwarded_request(server: Server) -> tuple[httpx.Response, str]:
    """GET /ui (redirected to /ui/, an absolute URL made from the request's scheme) with
    X-Forwarded-*; the answer and the server's access log line for it."""
    probe = uuid.uuid4().hex
    response = httpx.get(f"{server.url}/ui?probe={probe}", headers=FORWARDED, timeout=30)
    assert response.status_code == 307, response.text
    line = wait_for(lambda: server.logged(probe), "the request's access log line", 30)
    assert line is not None
    return response, line


def test_forwarded_headers_are_not_believed_by_default(server: Server) -> None:
    response, line = forwarded_request(server)
    assert response.headers["location"].startswith(f"http://127.0.0.1:{server.port}/ui/")
    assert line.split()[1].startswith("127.0.0.1:") and "203.0.113.9" not in line, line


def test_forwarded_headers_are_believed_from_a_configured_proxy(tmp_path: Path) -> None:
    """With --workers: the settings reach every API process."""
    with postgres_database() as url, layerswap_serve(
        tmp_path, "--workers", "2", LAYERSWAP_DATABASE_URL=url,
        LAYERSWAP_FORWARDED_ALLOW_IPS="127.0.0.1",
    ) as server:  # fmt: skip
        for _ in range(4):  # on fresh connections, taken by whichever process
            response, line = forwarded_request(server)
            assert response.headers["location"].startswith(f"https://127.0.0.1:{server.port}/")
            assert line.split()[1] == "203.0.113.9:0", line
        slow = opened(server, 20, HEAD)
        answers = held_until_closed(dict.fromkeys(slow, b"X-Trickle: 1\r\n"))
        assert all(raw.startswith(b"HTTP/1.1 408 ") for raw in answers if raw)
