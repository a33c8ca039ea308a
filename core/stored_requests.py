"""The size of what a job or sweep stores as its request. Bounded, so that no later read of
it (a job's view, a page of fifty, a worker's claim) costs more than a bounded amount, however
small the body that asked for it was."""

from __future__ import annotations

import json
from typing import Any

from core.errors import RequestTooLarge
from core.settings import Settings


def stored_size(request: dict[str, Any]) -> int:
    """Bytes of the request as a JSON column holds it (dates and such as their text)."""
    return len(json.dumps(request, default=str).encode())


def check_stored_size(
    request: dict[str, Any], settings: Settings, *, field: str | None = None
) -> None:
    """RequestTooLarge unless `request` fits `max_stored_request_bytes`, naming `field` or
    else the request's largest part."""
    size, limit = stored_size(request), settings.max_stored_request_bytes
    if size <= limit:
        return
    named = field or max(request, key=lambda key: stored_size({key: request[key]}), default="body")
    raise RequestTooLarge(
        f"{named}: the request would be stored as {size} bytes of JSON; at most {limit}",
        details={"field": named, "limit": limit},
    )
