"""The delivery loop, in every API process: claim due deliveries (compare-and-set, so several
processes never send one twice at once), sign (Standard Webhooks), POST to the checked address,
and record the attempt. Failures are retried on an exponential schedule with jitter for
`webhook_retry_window_s` (3 days), later if the receiver asks (Retry-After); 410 Gone disables
the endpoint. A process killed mid-send leaves a claim that lapses, and another sends again
with the same webhook-id (receivers deduplicate by it)."""

from __future__ import annotations

import email.utils
import json
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import and_, or_, select, update
from standardwebhooks.webhooks import Webhook

from service.db.models import (
    Tenant,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    as_utc,
    utcnow,
)
from service.db.session import Database
from service.settings import Settings
from service.webhooks.network import UnsafeUrl, check_url
from service.webhooks.outbox import DELIVERED, FAILED, PENDING, fail_pending

log = logging.getLogger("layerswap.webhooks")

MAX_DELAY_S = 12 * 3600.0
MAX_RETRY_AFTER_S = 24 * 3600.0
BATCH = 32


def retry_delay(attempt: int, base_s: float, rng: random.Random | None = None) -> float:
    """Seconds before attempt `attempt + 1`: base × 3^(attempt-1), at most 12 h, ±25 % jitter
    (5 s, 15 s, 45 s, ~2 min, ~7 min, 20 min, 1 h, 3 h, 9 h, then 12 h: about 3 days by the
    14th attempt)."""
    delay = min(base_s * 3 ** (attempt - 1), MAX_DELAY_S)
    return float(delay * (rng or random).uniform(0.75, 1.25))


def retry_after(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = (as_utc(when) - utcnow()).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


@dataclass(frozen=True)
class Outcome:
    status_code: int | None
    error: str | None  # None: delivered
    retry_after_s: float | None = None
    gone: bool = False  # 410: disable the endpoint
    retry: bool = True


class Deliverer:
    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="layerswap-webhooks", daemon=True)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="layerswap-webhook")
        timeout = httpx.Timeout(
            settings.webhook_timeout_s, connect=min(5.0, settings.webhook_timeout_s)
        )
        self._client = httpx.Client(timeout=timeout, follow_redirects=False, trust_env=False)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self._pool.shutdown(wait=True)
        self._client.close()

    def _loop(self) -> None:
        while not self._stop.wait(self.settings.webhook_interval_s):
            try:
                self.run_once()
            except Exception as e:  # the database is away, say: next round
                log.warning(
                    "webhook delivery round failed: %s", str(e).splitlines()[0] if str(e) else e
                )

    def run_once(self) -> int:
        """Send every delivery due now; returns how many were attempted."""
        claimed = self._claim()
        list(self._pool.map(self._attempt, claimed))
        return len(claimed)

    def _claim(self) -> list[tuple[str, int]]:
        now = utcnow()
        lease = timedelta(seconds=2 * self.settings.webhook_timeout_s + 5)
        free = or_(WebhookDelivery.locked_until.is_(None), WebhookDelivery.locked_until < now)
        due = and_(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now, free)
        claimed = []
        with self.db.session() as session:
            rows = session.execute(
                select(WebhookDelivery.id, WebhookDelivery.attempts)
                .where(due)
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(BATCH)
            ).all()
        for delivery_id, attempts in rows:
            with self.db.session() as session:
                moved: Any = session.execute(
                    update(WebhookDelivery)
                    .where(
                        WebhookDelivery.id == delivery_id, WebhookDelivery.attempts == attempts, due
                    )
                    .values(locked_until=now + lease, attempts=attempts + 1)
                )
            if int(moved.rowcount) == 1:
                claimed.append((delivery_id, attempts + 1))
        return claimed

    def _attempt(self, claim: tuple[str, int]) -> None:
        delivery_id, attempt = claim
        try:
            self._send_and_record(delivery_id, attempt)
        except Exception:
            log.exception(
                "webhook delivery %s: attempt %d failed unexpectedly", delivery_id, attempt
            )

    def _send_and_record(self, delivery_id: str, attempt: int) -> None:
        with self.db.session() as session:
            delivery = session.get(WebhookDelivery, delivery_id)
            assert delivery is not None
            event = session.get(WebhookEvent, delivery.event_id)
            assert event is not None
            endpoint = (
                session.get(WebhookEndpoint, delivery.endpoint_id) if delivery.endpoint_id else None
            )
            tenant = session.get(Tenant, delivery.tenant_id)
            session.expunge_all()
        started = time.monotonic()
        if endpoint is not None and (endpoint.deleted_at or endpoint.disabled_at):
            why = "the endpoint was deleted" if endpoint.deleted_at else "the endpoint is disabled"
            outcome = Outcome(None, why, retry=False)
        else:
            secret = (
                endpoint.secret
                if endpoint is not None
                else (tenant.webhook_secret if tenant else None)
            )
            url = endpoint.url if endpoint is not None else delivery.url
            assert secret is not None
            outcome = self._send(url, event, secret)
        self._record(delivery, attempt, outcome, time.monotonic() - started)

    def _send(self, url: str, event: WebhookEvent, secret: str) -> Outcome:
        try:
            target = check_url(url, self.settings.webhook_allowed_networks)
        except UnsafeUrl as e:
            return Outcome(None, f"refused: {e}")
        body = json.dumps(self._absolute(event.payload), separators=(",", ":"), sort_keys=True)
        now = datetime.now(UTC)
        headers = {
            "content-type": "application/json",
            "user-agent": "Layerswap-Webhooks/0.1",
            "webhook-id": event.id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": Webhook(secret).sign(event.id, now, body),
        }
        parts = urlsplit(url)
        headers["host"] = parts.netloc.rsplit("@", 1)[-1]
        literal = f"[{target.address}]" if target.address.version == 6 else str(target.address)
        pinned = urlunsplit(
            (parts.scheme, f"{literal}:{target.port}", parts.path or "/", parts.query, "")
        )
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        try:
            response = self._client.post(
                pinned, content=body, headers=headers, extensions=extensions
            )
        except httpx.TimeoutException:
            return Outcome(None, f"timed out after {self.settings.webhook_timeout_s:g} s")
        except httpx.HTTPError as e:
            return Outcome(None, f"{type(e).__name__}: {e}"[:500])
        if 200 <= response.status_code < 300:
            return Outcome(response.status_code, None)
        excerpt = response.text[:200].strip()
        error = f"answered {response.status_code}" + (f": {excerpt}" if excerpt else "")
        if 300 <= response.status_code < 400:
            error += " (redirects are not followed)"
        return Outcome(
            response.status_code, error, retry_after(response), gone=response.status_code == 410
        )

    def _absolute(self, payload: dict[str, Any]) -> dict[str, Any]:
        base = (self.settings.public_url or "").rstrip("/")
        if not base:
            return payload
        data = dict(payload["data"])
        data["links"] = {k: base + v for k, v in data.get("links", {}).items()}
        return {**payload, "data": data}

    def _record(
        self, delivery: WebhookDelivery, attempt: int, outcome: Outcome, seconds: float
    ) -> None:
        now = utcnow()
        entry = {
            "attempt": attempt,
            "at": now.isoformat(),
            "status_code": outcome.status_code,
            "error": outcome.error,
            "duration_ms": round(seconds * 1000, 1),
        }
        values: dict[str, Any] = {
            "attempt_log": [*delivery.attempt_log, entry],
            "locked_until": None,
            "last_error": outcome.error,
        }
        if outcome.error is None:
            values.update(status=DELIVERED, finished_at=now)
        elif outcome.gone or not outcome.retry:
            values.update(status=FAILED, finished_at=now)
        else:
            delay = retry_delay(attempt, self.settings.webhook_retry_base_s)
            if outcome.retry_after_s is not None:
                delay = max(delay, outcome.retry_after_s)
                entry["retry_after_s"] = outcome.retry_after_s
            deadline = as_utc(delivery.created_at) + timedelta(
                seconds=self.settings.webhook_retry_window_s
            )
            if now + timedelta(seconds=delay) > deadline:
                values.update(status=FAILED, finished_at=now)
                values["last_error"] = f"gave up after {attempt} attempts: {outcome.error}"
            else:
                values["next_attempt_at"] = now + timedelta(seconds=delay)
                entry["next_attempt_at"] = values["next_attempt_at"].isoformat()
        with self.db.session() as session:
            moved: Any = session.execute(
                update(WebhookDelivery)
                .where(WebhookDelivery.id == delivery.id, WebhookDelivery.attempts == attempt)
                .where(WebhookDelivery.status == PENDING)
                .values(**values)
            )
            if int(moved.rowcount) != 1:
                return  # replayed or superseded meanwhile: that attempt's record stands
            if outcome.gone and delivery.endpoint_id:
                disable(session, delivery.endpoint_id, f"answered 410 Gone at {now.isoformat()}")
        level = logging.INFO if outcome.error is None else logging.WARNING
        log.log(level, "webhook %s attempt %d to %s: %s", delivery.event_id, attempt,
                delivery.url, outcome.error or outcome.status_code)  # fmt: skip


def disable(session: Any, endpoint_id: str, reason: str) -> None:
    """Disable an endpoint; its pending deliveries fail (a re-enabled endpoint gets new events;
    old ones can be replayed)."""
    session.execute(
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.disabled_at.is_(None))
        .values(disabled_at=utcnow(), disabled_reason=reason)
    )
    fail_pending(session, endpoint_id, f"endpoint disabled: {reason}")
