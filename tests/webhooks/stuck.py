"""Receivers that never finish answering, as real sockets on 127.0.0.1: one accepts and reads
the request and then says nothing; one starts a 200 answer and sends it one byte a second,
forever (every read gets a byte in time, so only a bound on the whole attempt ends it)."""

from __future__ import annotations

import socket
import threading
from typing import Literal

Mode = Literal["silent", "drip"]


class StuckServer:
    def __init__(self, mode: Mode) -> None:
        self.mode = mode
        self.accepted = 0  # connections taken so far
        self.open = 0  # connections the sender has not closed yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self._sock.settimeout(0.1)
        self.port = int(self._sock.getsockname()[1])
        self._thread = threading.Thread(target=self._accept, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/{self.mode}"

    def start(self) -> StuckServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                connection, _ = self._sock.accept()
            except TimeoutError:
                continue
            with self._lock:
                self.accepted += 1
                self.open += 1
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            connection.settimeout(1.0)
            self._read_request(connection)
            if self.mode == "drip":
                self._drip(connection)
            else:
                self._wait_for_close(connection)
        finally:
            connection.close()
            with self._lock:
                self.open -= 1

    def _read_request(self, connection: socket.socket) -> None:
        received = b""
        while b"\r\n\r\n" not in received and not self._stop.is_set():
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                continue
            if not chunk:
                return
            received += chunk

    def _drip(self, connection: socket.socket) -> None:
        answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nx-slow: " + b"." * 100_000
        for byte in answer:
            if self._stop.wait(1.0):
                return
            try:
                connection.sendall(bytes([byte]))
            except OSError:  # the sender gave up and closed the connection
                return

    def _wait_for_close(self, connection: socket.socket) -> None:
        while not self._stop.is_set():
            try:
                if not connection.recv(65536):
                    return  # the sender gave up and closed the connection
            except TimeoutError:
                continue
            except OSError:
                return
