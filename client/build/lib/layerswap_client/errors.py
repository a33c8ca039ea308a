"""Errors the client raises: the service's own error body, typed."""

from __future__ import annotations

from typing import Any


class LayerswapError(Exception):
    """An error answer of the service: HTTP status, stable code, message, details."""

    def __init__(self, status: int, code: str, message: str, details: dict[str, Any]) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code, self.message, self.details = status, code, message, details


class WaitTimeout(TimeoutError):
    """wait() gave up before the job or sweep ended; `last` is what was seen last."""

    def __init__(self, what: str, last: Any) -> None:
        super().__init__(f"{what} did not end in time (last seen: {getattr(last, 'status', '?')})")
        self.last = last
