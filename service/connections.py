"""The HTTP connections `layerswap serve` accepts, bounded in time and in number.

uvicorn closes an idle kept-alive connection, and nothing else: a client that opens a connection
and sends its request head a line at a time, or a body that never ends, holds the connection (a
file descriptor and a parser) for as long as it likes. So each request gets deadlines on what the
client sends, and a process holds at most `max_connections` connections:

- the head (request line and headers) must be complete within `header_timeout_s` of the
  connection opening, or of the request's first byte on a kept-alive connection;
- the body must be complete within `body_timeout_s` of the head, however it trickles (a
  deadline that passes while the server itself is not reading, or has not yet asked for a body
  sent with `Expect: 100-continue`, is renewed);
- past either, the client is answered 408 (when no answer has begun) and the connection closed;
- a connection beyond `max_connections` is answered 503 and closed as it is accepted (uvicorn's
  `limit_concurrency`, set to the same number, answers 503 to requests at the limit).

Once a request is in, the app answers at its own pace: long polls and event streams are theirs.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import sys
from dataclasses import dataclass
from typing import Any, Literal

from uvicorn.config import Config
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
from uvicorn.server import ServerState

if sys.platform != "win32":
    import resource

log = logging.getLogger("uvicorn.error")
Phase = Literal["head", "body"]
# Files a process opens beside its connections: database connections, checkpoints, webhooks.
OTHER_FILES = 1024


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float
    body_timeout_s: float
    max_connections: int


def bounded_protocol(limits: ConnectionLimits) -> functools.partial[BoundedHttp]:
    """What uvicorn's `http=` is given: it calls this as it would a protocol class. A partial
    of a module-level class pickles, so the processes of `--workers` get the same limits; this
    module imports nothing of the service, so unpickling it is quick (a new process must answer
    its supervisor's first health check within 5 s)."""
    return functools.partial(BoundedHttp, limits=limits)


def raise_open_files(max_connections: int) -> tuple[int, int]:
    """Raise this process's open-files limit (which the processes it starts inherit) toward its
    hard limit, to hold `max_connections` connections and OTHER_FILES more: many containers
    start processes at 1024. (The limit now, the limit wanted.)"""
    wanted = max_connections + OTHER_FILES
    if sys.platform == "win32":  # no such limit
        return wanted, wanted
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return wanted, wanted
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    return raised, wanted


def answer(status: int, code: str, message: str, details: dict[str, Any]) -> bytes:
    """A whole HTTP/1.1 answer in the service's error shape, closing the connection."""
    body = json.dumps({"error": {"code": code, "message": message, "details": details}})
    reason = {408: "Request Timeout", 503: "Service Unavailable"}[status]
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-content-type-options: nosniff\r\n"
        "connection: close\r\n\r\n"
    )
    return (head + body).encode()


class BoundedHttp(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline on each request's head and body."""

    def __init__(
        self,
        config: Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
        *,
        limits: ConnectionLimits,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self.refuse()
        else:
            self.expect("head")  # from the start: a connection that never sends is closed too

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self.deadline is None:  # the first request's deadline runs from the connection
            self.expect("head")

    def on_headers_complete(self) -> None:
        self.expect("body")  # a request without one completes at once, disarming it
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.disarm()
        super().on_message_complete()

    def expect(self, phase: Phase) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(self.seconds(phase), self.expired, phase)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expired(self, phase: Phase) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.waiting_on_server(phase):
            self.expect(phase)
            return
        seconds = self.seconds(phase)
        what = "head (request line and headers)" if phase == "head" else "body"
        log.warning("%s: the request's %s took over %g s; closing", self.peer(), what, seconds)
        timeout = answer(
            408, "request_timeout", f"the request's {what} did not arrive within {seconds:g} s",
            {"field": "headers" if phase == "head" else "body", "limit_s": seconds},
        )  # fmt: skip
        self.close_with(timeout if self.unanswered(phase) else b"")

    def waiting_on_server(self, phase: Phase) -> bool:
        """Whether nothing arrives because of the server: it paused reading (flow control, a
        pipelined request), or has not yet asked for a body the client holds back until asked
        (Expect: 100-continue)."""
        cycle: RequestResponseCycle | None = self.cycle
        holding = phase == "body" and cycle is not None and cycle.waiting_for_100_continue
        return self.flow.read_paused or holding

    def seconds(self, phase: Phase) -> float:
        return self.limits.header_timeout_s if phase == "head" else self.limits.body_timeout_s

    def unanswered(self, phase: Phase) -> bool:
        """Whether an answer may be written now: none is under way on the connection. While a
        head is read, `cycle` is the previous request's (None before the first)."""
        cycle: RequestResponseCycle | None = self.cycle
        if phase == "head":
            return cycle is None or cycle.response_complete
        return cycle is not None and not cycle.response_started

    def refuse(self) -> None:
        limit = self.limits.max_connections
        log.warning("%s: over %d open connections; refused", self.peer(), limit)
        self.close_with(answer(
            503, "too_many_connections",
            f"this server holds at most {limit} connections at once; try again shortly",
            {"limit": limit},
        ))  # fmt: skip

    def close_with(self, response: bytes) -> None:
        """Write `response` (b"": none) and close. A request still being answered sees its
        client gone: the app's own answer, if it makes one, is dropped."""
        self.transport.write(response)
        cycle = self.cycle
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def peer(self) -> str:
        return f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
