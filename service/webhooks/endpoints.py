"""A tenant's webhook endpoints and their deliveries: create (the secret shown once), list,
read, delete, rotate the secret, re-enable, deliveries with every attempt, replay."""

from __future__ import annotations

import uuid
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select, update

from service import jobs
from service.db.models import WebhookDelivery, WebhookEndpoint, WebhookEvent, as_utc, utcnow
from service.db.session import Database
from service.errors import Conflict, InvalidRequest, NotFound
from service.settings import Settings
from service.webhooks.network import UnsafeUrl, check_url
from service.webhooks.outbox import EVENT_TYPES, PENDING, fail_pending, new_secret, tenant_secret

EventType = Literal[
    "merge.succeeded", "merge.failed", "merge.canceled", "analysis.completed",
    "evaluation.completed", "sweep.completed", "artifact.published",
]  # fmt: skip
assert set(get_args(EventType)) == set(EVENT_TYPES)


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


def check_webhook_url(url: str, settings: Settings, *, field: str) -> None:
    try:
        check_url(url, settings.webhook_allowed_networks)
    except UnsafeUrl as e:
        raise InvalidRequest(f"{field}: {e}", details={"field": field}) from None


def endpoint_view(endpoint: WebhookEndpoint, *, secret: bool = False) -> dict[str, Any]:
    view: dict[str, Any] = {
        "id": endpoint.id,
        "url": endpoint.url,
        "events": endpoint.events,
        "description": endpoint.description,
        "status": "disabled" if endpoint.disabled_at else "enabled",
        "disabled_reason": endpoint.disabled_reason,
        "created_at": as_utc(endpoint.created_at).isoformat(),
    }
    if secret:
        view["secret"] = endpoint.secret
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
) -> WebhookEndpoint:
    check_webhook_url(body.url, settings, field="url")
    jobs.ensure_tenant(db, tenant)
    endpoint = WebhookEndpoint(
        id=uuid.uuid4().hex, tenant_id=tenant, url=body.url,
        events=list(dict.fromkeys(body.events)), description=body.description,
        secret=new_secret(), created_at=utcnow(),
    )  # fmt: skip
    with db.session() as session:
        session.add(endpoint)
        session.flush()
        session.expunge(endpoint)
    return endpoint


def get_endpoint(db: Database, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    with db.session() as session:
        endpoint = session.get(WebhookEndpoint, endpoint_id) if jobs.is_id(endpoint_id) else None
        if endpoint is None or endpoint.tenant_id != tenant or endpoint.deleted_at is not None:
            raise NotFound(f"no such webhook endpoint: {endpoint_id}")
        session.expunge(endpoint)
        return endpoint


def list_endpoints(db: Database, tenant: str) -> list[WebhookEndpoint]:
    with db.session() as session:
        found = list(
            session.scalars(
                select(WebhookEndpoint)
                .where(WebhookEndpoint.tenant_id == tenant, WebhookEndpoint.deleted_at.is_(None))
                .order_by(WebhookEndpoint.created_at)
            )
        )
        session.expunge_all()
        return found


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


def rotate_secret(db: Database, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    """A new secret signs every attempt from now on (retries of old events too)."""
    get_endpoint(db, tenant, endpoint_id)
    with db.session() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(secret=new_secret())
        )
    return get_endpoint(db, tenant, endpoint_id)


def enable(db: Database, tenant: str, endpoint_id: str) -> WebhookEndpoint:
    get_endpoint(db, tenant, endpoint_id)
    with db.session() as session:
        session.execute(
            update(WebhookEndpoint)
            .where(WebhookEndpoint.id == endpoint_id)
            .values(disabled_at=None, disabled_reason=None)
        )
    return get_endpoint(db, tenant, endpoint_id)


def one_off_secret(db: Database, tenant: str) -> str:
    jobs.ensure_tenant(db, tenant)
    with db.session() as session:
        return tenant_secret(session, tenant)


def list_deliveries(
    db: Database,
    tenant: str,
    *,
    endpoint_id: str | None = None,
    subject_id: str | None = None,
    status: str | None = None,
    limit: int = 100,
) -> list[dict[str, Any]]:
    """Newest first; an endpoint's, or every delivery about one job or sweep (one-off ones
    included)."""
    query = (
        select(WebhookDelivery, WebhookEvent)
        .join(WebhookEvent, WebhookEvent.id == WebhookDelivery.event_id)
        .where(WebhookDelivery.tenant_id == tenant)
    )
    if endpoint_id is not None:
        query = query.where(WebhookDelivery.endpoint_id == endpoint_id)
    if subject_id is not None:
        if not jobs.is_id(subject_id):
            return []  # names nothing (and PostgreSQL would refuse the NUL byte)
        query = query.where(WebhookEvent.subject_id == subject_id)
    if status is not None:
        query = query.where(WebhookDelivery.status == status)
    query = query.order_by(WebhookDelivery.created_at.desc(), WebhookDelivery.id.desc())
    query = query.limit(limit)
    with db.session() as session:
        return [delivery_view(d, e) for d, e in session.execute(query).all()]


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
