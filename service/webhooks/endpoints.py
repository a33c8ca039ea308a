"""A tenant's webhook endpoints and their deliveries: create (the secret shown once; at most
`webhook_max_endpoints` per tenant), list (page by page), read, delete, rotate the secret (the
old one signs beside the new one for an overlap), re-enable, deliveries with every attempt,
replay. Secrets are stored encrypted (core/webhooks/encryption.py)."""

from __future__ import annotations

import uuid
from datetime import timedelta
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import and_, func, or_, select, update

from core import jobs
from core.cursors import decode_cursor, encode_cursor
from core.db.models import (
    Tenant,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    as_utc,
    utcnow,
)
from core.db.session import Database
from core.errors import Conflict, InvalidRequest, NotFound, ServiceError
from core.settings import Settings
from core.webhooks.encryption import box_for
from core.webhooks.outbox import EVENT_TYPES, PENDING, fail_pending, new_secret, tenant_secret
from service.webhooks.network import UnsafeUrl, check_url

EventType = Literal[
    "merge.succeeded", "merge.failed", "merge.canceled", "analysis.completed",
    "evaluation.completed", "sweep.completed", "artifact.published",
]  # fmt: skip
assert set(get_args(EventType)) == set(EVENT_TYPES)


class EndpointLimit(ServiceError):
    """409: the tenant has as many endpoints as it may; deleting one makes room."""

    code = "webhook_endpoint_limit"
    status = 409


def _all_events() -> list[EventType]:
    return list(get_args(EventType))


class EndpointCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2000, description="http(s) URL of a public address")
    events: list[EventType] = Field(
        default_factory=_all_events,
        min_length=1,
        description="event types to receive (default: all)",
    )
    description: str = Field("", max_length=500)


class SecretRotation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    overlap_s: float | None = Field(
        None,
        ge=0,
        le=7 * 24 * 3600,
        description="how long the old secret also signs (default: the service's "
        "LAYERSWAP_WEBHOOK_SECRET_OVERLAP_S; 0: not at all, for a secret that leaked)",
    )


def check_webhook_url(url: str, settings: Settings, *, field: str) -> None:
    try:
        check_url(url, settings.webhook_allowed_networks)
    except UnsafeUrl as e:
        raise InvalidRequest(f"{field}: {e}", details={"field": field}) from None


def endpoint_view(endpoint: WebhookEndpoint, *, secret: str | None = None) -> dict[str, Any]:
    """The endpoint as the API shows it; `secret` (plaintext) only at creation and rotation."""
    until = as_utc(endpoint.previous_secret_until)
    overlapping = endpoint.previous_secret is not None and until is not None and until > utcnow()
    view: dict[str, Any] = {
        "id": endpoint.id,
        "url": endpoint.url,
        "events": endpoint.events,
        "description": endpoint.description,
        "status": "disabled" if endpoint.disabled_at else "enabled",
        "disabled_reason": endpoint.disabled_reason,
        "created_at": as_utc(endpoint.created_at).isoformat(),
        # until then the secret before the last rotation also signs
        "previous_secret_expires_at": until.isoformat() if overlapping and until else None,
    }
    if secret is not None:
        view["secret"] = secret
    return view


def delivery_view(delivery: WebhookDelivery, event: WebhookEvent) -> dict[str, Any]:
    return {
        "id": delivery.id,
        "webhook_id": event.id,
        "type": event.type,
        "subject_id": event.subject_id,
        "endpoint_id": delivery.endpoint_id,
        "url": delivery.url,
        "status": delivery.status,
        "attempts": delivery.attempt_log,
        "next_attempt_at": as_utc(delivery.next_attempt_at).isoformat()
        if delivery.status == PENDING
        else None,
        "last_error": delivery.last_error,
        "created_at": as_utc(delivery.created_at).isoformat(),
        "finished_at": finished.isoformat() if (finished := as_utc(delivery.finished_at)) else None,
        "payload": event.payload,
    }


def create_endpoint(
    db: Database, settings: Settings, tenant: str, body: EndpointCreate
) -> tuple[WebhookEndpoint, str]:
    """The new endpoint and its secret (plaintext, to show once)."""
    check_webhook_url(body.url, settings, field="url")
    jobs.ensure_tenant(db, tenant)
    secret = new_secret()
    endpoint = WebhookEndpoint(
        id=uuid.uuid4().hex, tenant_id=tenant, url=body.url,
        events=list(dict.fromkeys(body.events)), description=body.description,
        secret=box_for(settings).encrypt(secret), created_at=utcnow(),
    )  # fmt: skip
    with db.session() as session:
        # A write to the tenant's row first: its creations take turns (PostgreSQL's row lock,
        # SQLite's one writer), so two at once cannot both see room for one more.
        session.execute(
            update(Tenant).where(Tenant.id == tenant).values(created_at=Tenant.created_at)
        )
        check_room(session, settings, tenant)
        session.add(endpoint)
        session.flush()
        session.expunge(endpoint)
    return endpoint, secret


def check_room(session: Any, settings: Settings, tenant: str) -> None:
    cap = settings.webhook_max_endpoints
    live = session.scalar(
        select(func.count())
        .select_from(WebhookEndpoint)
        .where(WebhookEndpoint.tenant_id == tenant, WebhookEndpoint.deleted_at.is_(None))
    )
    if int(live or 0) >= cap:
        raise EndpointLimit(
            f"this tenant has {live} webhook endpoints, the most it may have "
            f"(LAYERSWAP_WEBHOOK_MAX_ENDPOINTS = {cap}); delete one first",
            details={"limit": cap, "endpoints": int(live or 0)},
        )


def get_endpoint(db: Database, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    with db.session() as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id) if jobs.is_id(endpoint_id) else None
        if endpoint is None or endpoint.tenant_id != tenant or endpoint.deleted_at is not None:
            raise NotFound(f"no such webhook endpoint: {endpoint_id}")
        session.expunge(endpoint)
        return endpoint


def list_endpoints(
    db: Database, tenant: str, *, cursor: str | None = None, limit: int = 50
) -> tuple[list[WebhookEndpoint], str | None]:
    """Oldest first, a page at a time; `cursor` continues after the previous page's last."""
    created, id_ = WebhookEndpoint.created_at, WebhookEndpoint.id
    query = select(WebhookEndpoint).where(
        WebhookEndpoint.tenant_id == tenant, WebhookEndpoint.deleted_at.is_(None)
    )
    if cursor:
        after, last_id = decode_cursor(cursor)
        query = query.where(or_(created > after, and_(created == after, id_ > last_id)))
    with db.session() as session:
        found = list(session.scalars(query.order_by(created, id_).limit(limit + 1)))
        session.expunge_all()
    page = found[:limit]
    more = len(found) > limit
    return page, encode_cursor(page[-1].created_at, page[-1].id) if more else None


def delete_endpoint(db: Database, tenant: str, endpoint_id: str) -> None:
    """Deleted endpoints receive nothing more; their pending deliveries fail, history stays."""
    get_endpoint(db, tenant, endpoint_id)
    with db.session() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(deleted_at=utcnow())
        )
        fail_pending(session, endpoint_id, "the endpoint was deleted")


def rotate_secret(
    db: Database, settings: Settings, tenant: str, endpoint_id: str, overlap_s: float | None
) -> tuple[WebhookEndpoint, str]:
    """A new secret signs every attempt from now on (retries of old events too); the old one
    signs beside it for `overlap_s` (default: the setting), so a receiver can switch without
    refusing events. Returns the endpoint and the new secret (plaintext, to show once)."""
    get_endpoint(db, tenant, endpoint_id)
    overlap = settings.webhook_secret_overlap_s if overlap_s is None else overlap_s
    secret = new_secret()
    until = utcnow() + timedelta(seconds=overlap) if overlap > 0 else None
    with db.session() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(
                # the right-hand sides read the row as it was: the old secret moves over
                previous_secret=WebhookEndpoint.secret if until else None,
                previous_secret_until=until,
                secret=box_for(settings).encrypt(secret),
            )
        )
    return get_endpoint(db, tenant, endpoint_id), secret


def enable(db: Database, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    get_endpoint(db, tenant, endpoint_id)
    with db.session() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(disabled_at=None, disabled_reason=None)
        )
    return get_endpoint(db, tenant, endpoint_id)


def one_off_secret(db: Database, settings: Settings, tenant: str) -> str:
    jobs.ensure_tenant(db, tenant)
    with db.session() as session:
        return tenant_secret(session, tenant, box_for(settings))


def list_deliveries(
    db: Database,
    tenant: str,
    *,
    endpoint_id: str | None = None,
    subject_id: str | None = None,
    status: str | None = None,
    cursor: str | None = None,
    limit: int = 100,
) -> tuple[list[dict[str, Any]], str | None]:
    """Newest first, a page at a time; an endpoint's, or every delivery about one job or sweep
    (one-off ones included)."""
    query = (
        select(WebhookDelivery, WebhookEvent)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.tenant_id == tenant)
    )
    if endpoint_id is not None:
        query = query.where(WebhookDelivery.endpoint_id == endpoint_id)
    if subject_id is not None:
        if not jobs.is_id(subject_id):
            return [], None  # names nothing (and PostgreSQL would refuse the NUL byte)
        query = query.where(WebhookEvent.subject_id == subject_id)
    if status is not None:
        query = query.where(WebhookDelivery.status == status)
    created, id_ = WebhookDelivery.created_at, WebhookDelivery.id
    if cursor:
        before, last_id = decode_cursor(cursor)
        query = query.where(or_(created < before, and_(created == before, id_ < last_id)))
    query = query.order_by(created.desc(), id_.desc()).limit(limit + 1)
    with db.session() as session:
        found = session.execute(query).all()
        page = [delivery_view(d, e) for d, e in found[:limit]]
    last = found[limit - 1][0] if len(found) > limit else None
    return page, encode_cursor(last.created_at, last.id) if last is not None else None


def replay(db: Database, tenant: str, delivery_id: str) -> dict[str, Any]:
    """Send an ended delivery again, now, with the same webhook-id (its attempts go on)."""
    with db.session() as session:
        delivery = session.get(WebhookDelivery, delivery_id) if jobs.is_id(delivery_id) else None
        if delivery is None or delivery.tenant_id != tenant:
            raise NotFound(f"no such delivery: {delivery_id}")
        if delivery.endpoint_id is not None:
            endpoint = session.get(WebhookEndpoint, delivery.endpoint_id)
            if endpoint is None or endpoint.deleted_at or endpoint.disabled_at:
                raise Conflict(
                    "the endpoint is disabled or deleted; enable it first",
                    details={"endpoint_id": delivery.endpoint_id},
                )
        moved: Any = session.execute(
            update(WebhookDelivery)
            .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status != PENDING)
            .values(status=PENDING, next_attempt_at=utcnow(), finished_at=None, locked_until=None)
        )
        if int(moved.rowcount) != 1:
            raise Conflict(f"delivery {delivery_id} is still pending", details={"status": PENDING})
        delivery = session.get(WebhookDelivery, delivery_id, populate_existing=True)
        event = session.get(WebhookEvent, delivery.event_id) if delivery else None
        assert delivery is not None and event is not None
        return delivery_view(delivery, event)
