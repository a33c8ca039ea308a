"""PostgreSQL goes away and comes back: 503 with Retry-After meanwhile, then recovery.

A small TCP proxy sits between the app and PostgreSQL; stopping it (listener and every live
connection) is the outage, starting it again on the same port is the recovery.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from tests.helpers import wait_for
from tests.service.conftest import Service, layer_swap, running_service


class TcpProxy:
    """127.0.0.1:<port> -> upstream, one pair of pump threads per connection."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self.port = 0  # chosen by the first start, reused by the next ones
        self._listener: socket.socket | None = None
        self._stopped = threading.Event()
        self._live: set[socket.socket] = set()
        self._lock = threading.Lock()

    def start(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        listener.settimeout(0.1)  # so the accept loop notices stop()
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._stopped = threading.Event()
        threading.Thread(
            target=self._accept, args=(listener, self._stopped), daemon=True, name="proxy-accept"
        ).start()

    def stop(self) -> None:
        """Refuse new connections and cut every live one."""
        self._stopped.set()
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            live, self._live = self._live, set()
        for sock in live:
            _close(sock)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._live)

    def _accept(self, listener: socket.socket, stopped: threading.Event) -> None:
        while not stopped.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed by stop()
            client.settimeout(None)
            try:
                server = socket.create_connection(self.upstream, timeout=10)
            except OSError:
                _close(client)
                continue
            server.settimeout(None)
            with self._lock:
                if stopped.is_set():
                    _close(client)
                    _close(server)
                    return
                self._live |= {client, server}
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._live -= {src, dst}
            _close(src)
            _close(dst)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


@pytest.fixture
def proxied(postgres_url: str) -> Iterator[tuple[TcpProxy, str]]:
    url = make_url(postgres_url)
    proxy = TcpProxy((url.host or "127.0.0.1", url.port or 5432))
    proxy.start()
    try:
        yield proxy, url.set(host="127.0.0.1", port=proxy.port).render_as_string(False)
    finally:
        proxy.stop()


def assert_unavailable(response: Any) -> None:
    assert response.status_code == 503, response.text
    assert int(response.headers["Retry-After"]) > 0
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["code"] == "database_unavailable"
    assert set(error) == {"code", "message", "details"}
    assert "Traceback" not in response.text


def test_database_outage_is_503_then_recovers(
    proxied: tuple[TcpProxy, str], tmp_path: Path, examples: Path
) -> None:
    proxy, url = proxied
    with running_service(tmp_path, url, examples) as service:
        before = service.submit(layer_swap())
        assert service.wait(before["id"])["status"] == "succeeded"
        assert proxy.connections > 0  # the app really talks to PostgreSQL through the proxy

        proxy.stop()
        assert_unavailable(service.client.get("/v1/merges"))
        assert_unavailable(service.client.get(f"/v1/merges/{before['id']}"))
        assert_unavailable(service.client.post("/v1/merges", json=layer_swap()))
        assert_unavailable(service.client.get("/readyz"))
        health = service.client.get("/healthz")
        assert health.status_code == 200
        assert health.json() == {"status": "ok"}

        proxy.start()
        assert_recovers(service)
        assert service.client.get("/readyz").status_code == 200

        after = service.submit(layer_swap())
        assert service.wait(after["id"])["status"] == "succeeded"
        listed = service.client.get("/v1/merges").json()["items"]
        # The POST refused during the outage left no job behind.
        assert [job["id"] for job in listed] == [after["id"], before["id"]]


def assert_recovers(service: Service, timeout: float = 30.0) -> None:
    """Poll until the pool has reconnected (fails the test at the deadline); until then every
    answer is the outage's."""

    def recovered() -> bool:
        response = service.client.get("/v1/merges")
        if response.status_code == 200:
            return True
        assert_unavailable(response)
        return False

    wait_for(recovered, "the service to recover from the outage", timeout, interval=0.1)
