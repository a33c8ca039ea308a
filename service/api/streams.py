"""Open Server-Sent Event streams, counted per tenant: each holds a connection and polls the
database, so one tenant must not be able to hold them all."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterable, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send


class StreamSlots:
    """At most `limit` open streams per tenant in this process (thread-safe: routes run in
    worker threads, streams end on the event loop)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, tenant: str) -> bool:
        with self._lock:
            if self._open.get(tenant, 0) >= self.limit:
                return False
            self._open[tenant] = self._open.get(tenant, 0) + 1
            return True

    def give_back(self, tenant: str) -> None:
        with self._lock:
            left = self._open.get(tenant, 0) - 1
            if left > 0:
                self._open[tenant] = left
            else:
                self._open.pop(tenant, None)

    def held(self, tenant: str) -> int:
        with self._lock:
            return self._open.get(tenant, 0)


class SlotStreamingResponse(StreamingResponse):
    """Gives its slot back however the response ends: the stream finished, the client went
    away, or sending failed before the stream's generator ever started (its own `finally`
    would then never run)."""

    def __init__(
        self, content: AsyncIterable[str], *, release: Callable[[], None], **kwargs: Any
    ) -> None:
        super().__init__(content, **kwargs)
        self._release: Callable[[], None] | None = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.release()

    def release(self) -> None:
        release, self._release = self._release, None  # once, even if called twice
        if release is not None:
            release()
