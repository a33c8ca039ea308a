"""A third party that is stuck: a real TCP server on 127.0.0.1 that accepts every connection and
then either never answers (`silent`) or answers a well-formed HTTP response one byte per
`interval` seconds, status line and headers included (`drip`), so that no per-read timeout ever
fires. It records what it saw: connections accepted, what the client sent on each (a request,
its body), and how many connections the client gave up on (closed from its side)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

from tests.helpers import wait_for

Mode = Literal["silent", "drip"]
BODY_BYTES = 1_000_000  # announced by a dripped answer: it would take days to send


class StuckServer:
    def __init__(self, mode: Mode, *, port: int = 0, interval: float = 1.0) -> None:
        self.mode, self.interval = mode, interval
        self.requests: list[bytearray] = []  # all a client sent, per connection that sent a request
        self.abandoned = 0  # connections the client closed before the answer was over
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clients: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", port))
        self._listener.listen(64)
        self._listener.settimeout(0.1)
        self.port = int(self._listener.getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def accepted(self) -> int:
        with self._lock:
            return len(self._clients)

    def start(self) -> StuckServer:
        self._spawn(self._accept)
        return self

    def stop(self) -> None:
        """Closes every socket, once no thread waits on it any more (a socket closed under a
        waiting thread lingers until that wait ends: the port would not be free at once)."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=10)
        self._listener.close()
        with self._lock:
            clients = list(self._clients)
        for client in clients:
            client.close()

    def _spawn(self, target: Callable[..., None], *args: Any) -> None:
        thread = threading.Thread(target=target, args=args, name=f"stuck-{self.port}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def __enter__(self) -> StuckServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()

    def wait_for(self, condition: Callable[[StuckServer], Any], what: str, timeout: float) -> Any:
        """`condition(self)`'s first truthy value, polled; fails the test at the deadline."""
        return wait_for(lambda: condition(self), what, timeout)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # stopped
            with self._lock:
                self._clients.append(client)
            self._spawn(self._serve, client)

    def _serve(self, client: socket.socket) -> None:
        client.settimeout(0.1)
        head = self._read_request(client)
        if head is None:
            return
        received = bytearray(head)
        with self._lock:
            self.requests.append(received)
        answer = self._answer() if self.mode == "drip" else b""
        started, sent = time.monotonic(), 0
        while not self._stop.is_set():
            if self._closed_by_client(client, received):
                with self._lock:
                    self.abandoned += 1
                return
            if self.mode == "drip" and time.monotonic() >= started + (sent + 1) * self.interval:
                try:
                    client.send(answer[sent : sent + 1])
                except OSError:
                    continue  # counted as abandoned on the next round
                sent += 1

    def _read_request(self, client: socket.socket) -> bytes | None:
        """The request's head (up to its blank line), or None once stopped or closed."""
        data = b""
        while b"\r\n\r\n" not in data:
            if self._stop.is_set():
                return None
            try:
                chunk = client.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return None
            if not chunk:
                with self._lock:
                    self.abandoned += 1
                return None
            data += chunk
        return data

    def _answer(self) -> bytes:
        head = (
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_BYTES}\r\n\r\n"
        )
        return head.encode() + b" " * BODY_BYTES

    @staticmethod
    def _closed_by_client(client: socket.socket, received: bytearray) -> bool:
        """Whether the client closed or reset the connection (waits up to the socket timeout);
        anything further it sends (a request body) is added to `received`."""
        try:
            data = client.recv(65536)
        except TimeoutError:
            return False
        except OSError:
            return True
        received.extend(data)
        return data == b""
