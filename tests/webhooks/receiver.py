"""A webhook receiver as a customer would write one: a real HTTP server that verifies every
request with the standardwebhooks library, records it, and answers what the test scripts
(status codes, Retry-After, a hold that keeps a request open). Stop and start it on the same
port to play a receiver that is down for a while."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from tests.helpers import wait_for  # also imported from here by tests of other packages


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: bytes
    verified: dict[str, Any] | None  # the payload if the signature checked out with a secret
    answered: int

    @property
    def webhook_id(self) -> str:
        return self.headers["webhook-id"]


@dataclass
class Reply:
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    hold: threading.Event | None = None  # wait for this before answering


class Receiver:
    def __init__(self) -> None:
        self.secrets: list[str] = []  # verify with any of these
        self.received: list[Received] = []
        self.script: list[Reply] = []  # answers for the next requests, then 200
        self.open = 0  # requests being handled now (held ones included)
        self.most_open = 0  # the most that were ever handled at once
        self._lock = threading.Lock()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        sock.close()
        self._server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks"

    def start(self) -> Receiver:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                headers = {k.lower(): v for k, v in self.headers.items()}
                with receiver._lock:
                    reply = receiver.script.pop(0) if receiver.script else Reply()
                    receiver.open += 1
                    receiver.most_open = max(receiver.most_open, receiver.open)
                try:
                    if reply.hold is not None:
                        reply.hold.wait(60)
                finally:
                    with receiver._lock:
                        receiver.open -= 1
                verified = receiver._verify(body, headers)
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, headers, body, verified, reply.status)
                    )
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("content-length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _verify(self, body: bytes, headers: dict[str, str]) -> dict[str, Any] | None:
        for secret in self.secrets:
            try:
                return dict(Webhook(secret).verify(body, headers))
            except WebhookVerificationError:
                continue
        return None

    def of_type(self, type_: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if json.loads(r.body)["type"] == type_]

    def wait_for(self, condition: Callable[[], Any], what: str, timeout: float = 60) -> Any:
        return wait_for(condition, what, timeout)
