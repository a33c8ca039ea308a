"""When and how long to retry: 429 and 503 (honouring Retry-After), and dropped connections
where a retry cannot create a second job (GETs, and job creation, which carries an
Idempotency-Key the service deduplicates by)."""

from __future__ import annotations

import email.utils
import random
import time
from datetime import UTC, datetime

import httpx

from layerswap_client.errors import LayerswapError

RETRY_STATUSES = frozenset({429, 503})
BASE_S, CAP_S = 0.5, 30.0


def delay(attempt: int, response: httpx.Response | None) -> float:
    """Seconds before retry `attempt + 1`: Retry-After if the service sent one, else
    exponential backoff with full jitter."""
    if response is not None and (value := response.headers.get("retry-after")):
        try:
            return min(max(float(value), 0.0), CAP_S * 4)
        except ValueError:
            try:
                when = email.utils.parsedate_to_datetime(value)
                seconds = (when - datetime.now(UTC)).total_seconds()
                return min(max(seconds, 0.0), CAP_S * 4)
            except (TypeError, ValueError):
                pass
    return random.uniform(0, min(CAP_S, BASE_S * 2**attempt))


def error_of(response: httpx.Response) -> LayerswapError:
    try:
        body = response.json().get("error") or {}
    except ValueError:
        body = {}
    return LayerswapError(
        response.status_code,
        str(body.get("code", "http_error")),
        str(body.get("message", response.text[:500] or response.reason_phrase)),
        dict(body.get("details") or {}),
    )


def sleep(seconds: float) -> None:
    time.sleep(seconds)
