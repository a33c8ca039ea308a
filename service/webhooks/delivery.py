"""The delivery loop, in every API process: claim due deliveries (compare-and-set, so several
processes never send one twice at once), sign (Standard Webhooks), POST to the checked address,
and record the attempt. Failures are retried on an exponential schedule with jitter for
`webhook_retry_window_s` (3 days), later if the receiver asks (Retry-After); 410 Gone disables
the endpoint. A process killed mid-send leaves a claim that lapses, and another sends again
with the same webhook-id (receivers deduplicate by it).

Fair and bounded: a process has at most `webhook_concurrency` attempts in flight, at most
`webhook_tenant_concurrency` of them for one tenant, and hands free slots out to the tenants
with due deliveries in turn (fewest in flight first, then the one waiting longest), so a
tenant's slow receivers hold its own share and never another tenant's. Every attempt, from the
connect to the last byte of the answer, ends within `webhook_timeout_s`: a receiver that never
answers, or trickles its answer, is cut off there (httpx's timeouts bound each read, not the
whole), and the attempt is recorded as failed and retried. The attempts are asyncio tasks on
one event loop thread; database work runs in a small thread pool."""

from __future__ import annotations

import asyncio
import contextlib
import email.utils
import json
import logging
import random
import threading
import time
from collections import Counter
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
from sqlalchemy import and_, func, or_, select, update
from sqlalchemy.orm import Session
from standardwebhooks.webhooks import Webhook

from core.db.models import WebhookDelivery, WebhookEndpoint, WebhookEvent, as_utc, utcnow
from core.db.session import Database
from core.settings import Settings
from core.webhooks.encryption import SecretKeyError, box_for, prepare
from core.webhooks.outbox import DELIVERED, FAILED, PENDING, fail_pending, tenant_secret
from service.webhooks.network import Target, UnsafeUrl, check_url

log = logging.getLogger("layerswap.webhooks")

MAX_DELAY_S = 12 * 3600.0
MAX_RETRY_AFTER_S = 24 * 3600.0
MAX_TENANTS = 1000  # tenants with due deliveries looked at per round (longest waiting first)
EXCERPT_BYTES = 1024  # of an error answer's body, kept in the attempt's record
DATABASE_THREADS = 8


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


@dataclass(frozen=True)
class Claim:
    delivery_id: str
    tenant: str
    attempt: int


@dataclass(frozen=True)
class Prepared:
    """What an attempt sends, read before sending; `refused`: decided without sending."""

    delivery: WebhookDelivery
    event: WebhookEvent
    url: str
    secrets: list[str]  # each signs; the newest first
    refused: Outcome | None


def fair_shares(
    waiting: list[tuple[str, int]], busy: Mapping[str, int], room: int, cap: int
) -> dict[str, int]:
    """Hand `room` free slots out one at a time to the tenant with the fewest attempts in
    flight (ties: the order of `waiting`, longest waiting first), never beyond `cap` in flight
    for one tenant nor beyond its due deliveries. `waiting`: (tenant, due deliveries)."""
    load = {tenant: busy.get(tenant, 0) for tenant, _ in waiting}
    left = dict(waiting)
    shares: Counter[str] = Counter()
    for _ in range(room):
        candidates = [t for t, _ in waiting if load[t] < cap and left[t] > 0]
        if not candidates:
            break
        tenant = min(candidates, key=load.__getitem__)  # the first of equals: longest waiting
        load[tenant] += 1
        left[tenant] -= 1
        shares[tenant] += 1
    return dict(shares)


class Deliverer:
    def __init__(self, db: Database, settings: Settings) -> None:
        self.db, self.settings = db, settings
        self.box = box_for(settings)  # a key that is not a key stops the start here
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="layerswap-webhooks", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._busy: Counter[str] = Counter()  # attempts in flight per tenant (the loop's own)

    def start(self) -> None:
        prepare(self.db, self.box)  # keys that cannot decrypt the stored secrets stop the start
        if not self.db.is_sqlite and not self.settings.webhook_secret_keys:
            log.info(
                "webhook secrets are encrypted with %s; API processes on other hosts need the "
                "same key: set LAYERSWAP_WEBHOOK_SECRET_KEYS", self.box.source,
            )  # fmt: skip
        self._thread.start()

    def stop(self) -> None:
        """Attempts in flight are abandoned: their claims lapse and they are sent again."""
        self._stop.set()
        loop, wake = self._loop, self._wake
        if loop is not None and wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop has ended already
                loop.call_soon_threadsafe(wake.set)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(
            ThreadPoolExecutor(DATABASE_THREADS, thread_name_prefix="layerswap-webhook")
        )
        self._wake, self._loop = asyncio.Event(), loop
        tasks: set[asyncio.Task[None]] = set()
        async with self._client() as client:
            while not self._stop.is_set():
                for claim in await self._claim_safely():
                    self._busy[claim.tenant] += 1
                    task = asyncio.create_task(self._attempt(client, claim))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self._pause()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _client(self) -> httpx.AsyncClient:
        bound = self.settings.webhook_timeout_s
        return httpx.AsyncClient(
            timeout=httpx.Timeout(bound, connect=min(5.0, bound)),
            limits=httpx.Limits(max_connections=self.settings.webhook_concurrency),
            follow_redirects=False,
            trust_env=False,
        )

    async def _pause(self) -> None:
        """Until the next round: the interval, or sooner when an attempt ends (a slot is free)
        or the loop is stopped."""
        assert self._wake is not None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), self.settings.webhook_interval_s)
        self._wake.clear()

    async def _claim_safely(self) -> list[Claim]:
        busy = dict(self._busy)
        room = self.settings.webhook_concurrency - sum(busy.values())
        if room <= 0:
            return []
        try:
            return await asyncio.to_thread(self._claim, busy, room)
        except Exception as e:  # boundary: the deliverer lives on; the database is away, say
            log.warning(
                "webhook delivery round failed: %s", str(e).splitlines()[0] if str(e) else e
            )
            return []

    def _due(self, now: datetime) -> Any:
        free = or_(WebhookDelivery.locked_until.is_(None), WebhookDelivery.locked_until < now)
        return and_(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now, free)

    def _claim(self, busy: dict[str, int], room: int) -> list[Claim]:
        """Claim up to `room` due deliveries, shared out fairly among the tenants waiting."""
        now = utcnow()
        tenant = WebhookDelivery.tenant_id
        with self.db.session() as session:
            waiting = session.execute(
                select(tenant, func.count())
                .where(self._due(now))
                .group_by(tenant)
                .order_by(func.min(WebhookDelivery.next_attempt_at))
                .limit(MAX_TENANTS)
            ).all()
        shares = fair_shares(
            [(t, int(n)) for t, n in waiting], busy, room, self.settings.webhook_tenant_concurrency
        )
        return [c for t, share in shares.items() for c in self._claim_for(t, share, now)]

    def _claim_for(self, tenant: str, share: int, now: datetime) -> list[Claim]:
        lease = timedelta(seconds=2 * self.settings.webhook_timeout_s + 5)
        due = self._due(now)
        with self.db.session() as session:
            rows = session.execute(
                select(WebhookDelivery.id, WebhookDelivery.attempts)
                .where(due, WebhookDelivery.tenant_id == tenant)
                .order_by(WebhookDelivery.next_attempt_at)
                .limit(share)
            ).all()
        claimed = []
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
                claimed.append(Claim(delivery_id, tenant, attempts + 1))
        return claimed

    async def _attempt(self, client: httpx.AsyncClient, claim: Claim) -> None:
        started = time.monotonic()
        try:
            prepared = await asyncio.to_thread(self._prepare, claim)
            outcome = prepared.refused or await self._send(client, prepared)
            seconds = time.monotonic() - started
            await asyncio.to_thread(
                self._record, prepared.delivery, claim.attempt, outcome, seconds
            )
        except Exception:  # boundary: one attempt's bug never ends the deliverer
            log.exception(
                "webhook delivery %s: attempt %d failed unexpectedly", claim.delivery_id,
                claim.attempt,
            )  # fmt: skip
        finally:
            self._busy[claim.tenant] -= 1
            if self._busy[claim.tenant] <= 0:
                del self._busy[claim.tenant]
            if self._wake is not None:
                self._wake.set()

    def _prepare(self, claim: Claim) -> Prepared:
        with self.db.session() as session:
            delivery = session.get(WebhookDelivery, claim.delivery_id)
            assert delivery is not None
            event = session.get(WebhookEvent, delivery.event_id)
            assert event is not None
            endpoint = (
                session.get(WebhookEndpoint, delivery.endpoint_id) if delivery.endpoint_id else None
            )
            url, secrets, refused = endpoint.url if endpoint else delivery.url, [], None
            if endpoint is not None and (endpoint.deleted_at or endpoint.disabled_at):
                why = (
                    "the endpoint was deleted"
                    if endpoint.deleted_at
                    else "the endpoint is disabled"
                )
                refused = Outcome(None, why, retry=False)
            else:
                try:
                    secrets = self._secrets(session, endpoint, delivery.tenant_id)
                except SecretKeyError as e:  # this process has the wrong keys; another may not
                    log.error("webhook delivery %s: %s", delivery.id, e)
                    refused = Outcome(None, str(e))
            session.expunge_all()
        return Prepared(delivery, event, url, secrets, refused)

    def _secrets(
        self, session: Session, endpoint: WebhookEndpoint | None, tenant: str
    ) -> list[str]:
        """The secrets that sign: the endpoint's, and its previous one while the rotation's
        overlap lasts; a one-off webhook's, the tenant's."""
        if endpoint is None:
            return [tenant_secret(session, tenant, self.box)]
        secrets = [self.box.decrypt(endpoint.secret)]
        until = as_utc(endpoint.previous_secret_until)
        if endpoint.previous_secret is not None and until is not None and until > utcnow():
            secrets.append(self.box.decrypt(endpoint.previous_secret))
        return secrets

    async def _send(self, client: httpx.AsyncClient, prepared: Prepared) -> Outcome:
        bound = self.settings.webhook_timeout_s
        try:
            async with asyncio.timeout(bound):
                return await self._post(client, prepared)
        except TimeoutError:
            return Outcome(None, f"timed out: no complete answer within {bound:g} s")

    async def _post(self, client: httpx.AsyncClient, prepared: Prepared) -> Outcome:
        networks = self.settings.webhook_allowed_networks
        try:
            target = await asyncio.to_thread(check_url, prepared.url, networks)
        except UnsafeUrl as e:
            return Outcome(None, f"refused: {e}")
        pinned, body, headers, extensions = self._request(prepared, target)
        try:
            async with client.stream(
                "POST", pinned, content=body, headers=headers, extensions=extensions
            ) as response:
                if 200 <= response.status_code < 300:
                    return Outcome(response.status_code, None)
                return failure(response, await excerpt(response))
        except httpx.TimeoutException:
            return Outcome(None, f"timed out after {self.settings.webhook_timeout_s:g} s")
        except httpx.HTTPError as e:
            return Outcome(None, f"{type(e).__name__}: {e}"[:500])

    def _request(
        self, prepared: Prepared, target: Target
    ) -> tuple[str, str, dict[str, str], dict[str, Any]]:
        """The pinned URL (the checked address), body, signed headers and TLS name."""
        event = prepared.event
        body = json.dumps(self._absolute(event.payload), separators=(",", ":"), sort_keys=True)
        now = datetime.now(UTC)
        signatures = " ".join(Webhook(s).sign(event.id, now, body) for s in prepared.secrets)
        parts = urlsplit(prepared.url)
        headers = {
            "content-type": "application/json",
            "accept-encoding": "identity",  # an error answer's excerpt is read as it comes
            "user-agent": "Layerswap-Webhooks/0.1",
            "webhook-id": event.id,
            "webhook-timestamp": str(int(now.timestamp())),
            "webhook-signature": signatures,
            "host": parts.netloc.rsplit("@", 1)[-1],
        }
        literal = f"[{target.address}]" if target.address.version == 6 else str(target.address)
        pinned = urlunsplit(
            (parts.scheme, f"{literal}:{target.port}", parts.path or "/", parts.query, "")
        )
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        return pinned, body, headers, extensions

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
        values = self._after(delivery, attempt, outcome, now, seconds)
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

    def _after(
        self,
        delivery: WebhookDelivery,
        attempt: int,
        outcome: Outcome,
        now: datetime,
        seconds: float,
    ) -> dict[str, Any]:
        """The delivery's columns after this attempt: delivered, failed for good, or due again
        (the retry schedule, Retry-After, within the retry window); the attempt logged."""
        entry: dict[str, Any] = {
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
        if outcome.error is None or outcome.gone or not outcome.retry:
            return {**values, "status": FAILED if outcome.error else DELIVERED, "finished_at": now}
        delay = retry_delay(attempt, self.settings.webhook_retry_base_s)
        if outcome.retry_after_s is not None:
            delay = max(delay, outcome.retry_after_s)
            entry["retry_after_s"] = outcome.retry_after_s
        window = timedelta(seconds=self.settings.webhook_retry_window_s)
        if now + timedelta(seconds=delay) > as_utc(delivery.created_at) + window:
            error = f"gave up after {attempt} attempts: {outcome.error}"
            return {**values, "status": FAILED, "finished_at": now, "last_error": error}
        values["next_attempt_at"] = now + timedelta(seconds=delay)
        entry["next_attempt_at"] = values["next_attempt_at"].isoformat()
        return values


def disable(session: Any, endpoint_id: str, reason: str) -> None:
    """Disable an endpoint; its pending deliveries fail (a re-enabled endpoint gets new events;
    old ones can be replayed)."""
    session.execute(
        update(WebhookEndpoint)
        .where(WebhookEndpoint.id == endpoint_id, WebhookEndpoint.disabled_at.is_(None))
        .values(disabled_at=utcnow(), disabled_reason=reason)
    )
    fail_pending(session, endpoint_id, f"endpoint disabled: {reason}")


async def excerpt(response: httpx.Response) -> str:
    """The start of an error answer's body: no more is read (it may be endless)."""
    data = b""
    async for chunk in response.aiter_raw():
        data += chunk
        if len(data) >= EXCERPT_BYTES:
            break
    return data[:EXCERPT_BYTES].decode(errors="replace")[:200].strip()


def failure(response: httpx.Response, body: str) -> Outcome:
    error = f"answered {response.status_code}" + (f": {body}" if body else "")
    if 300 <= response.status_code < 400:
        error += " (redirects are not followed)"
    return Outcome(
        response.status_code, error, retry_after(response), gone=response.status_code == 410
    )
