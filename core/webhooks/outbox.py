"""The outbox: an event is written, with one delivery per subscribed endpoint (and the job's own
one-off URL), in the same transaction as the state change it reports. A process that dies after
the commit loses nothing (the delivery loop finds it); one that dies before it never changed the
state. Payloads are thin: ids, status and links; receivers fetch the rest."""

from __future__ import annotations

import base64
import secrets
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.db.models import (
    Job,
    Tenant,
    WebhookDelivery,
    WebhookEndpoint,
    WebhookEvent,
    utcnow,
)
from core.kinds import KINDS

if TYPE_CHECKING:
    from core.webhooks.encryption import SecretBox

EVENT_TYPES = (
    "merge.succeeded",
    "merge.failed",
    "merge.canceled",
    "analysis.completed",
    "evaluation.completed",
    "sweep.completed",
    "artifact.published",
)
PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"


def new_secret() -> str:
    return "whsec_" + base64.b64encode(secrets.token_bytes(32)).decode()


def tenant_secret(session: Session, tenant: str, box: SecretBox) -> str:
    """The secret that signs a tenant's one-off webhooks, made once (compare-and-set) and
    stored encrypted; made where it is first needed (the API, the delivery loop), so the
    processes that only write events (workers) never need the key."""
    session.execute(
        update(Tenant)
        .where(Tenant.id == tenant, Tenant.webhook_secret.is_(None))
        .values(webhook_secret=box.encrypt(new_secret()))
    )
    row = session.get(Tenant, tenant, populate_existing=True)
    assert row is not None and row.webhook_secret is not None
    return box.decrypt(row.webhook_secret)


def emit(
    session: Session,
    *,
    tenant: str,
    type_: str,
    subject_id: str,
    data: dict[str, Any],
    one_off_url: str | None = None,
) -> WebhookEvent | None:
    """Queue `type_` for every endpoint of `tenant` subscribed to it, and for `one_off_url`;
    nothing is written when no one listens."""
    assert type_ in EVENT_TYPES, type_
    endpoints = subscribed(session, tenant, type_)
    if not endpoints and one_off_url is None:
        return None
    now = utcnow()
    event = WebhookEvent(
        id=f"msg_{uuid.uuid4().hex}",
        tenant_id=tenant,
        type=type_,
        subject_id=subject_id,
        payload={"type": type_, "timestamp": now.isoformat(), "data": data},
        created_at=now,
    )
    session.add(event)
    session.flush()  # before its deliveries (no ORM relationship orders the two inserts)
    targets: list[tuple[str | None, str]] = [(e.id, e.url) for e in endpoints]
    if one_off_url is not None:
        targets.append((None, one_off_url))
    for endpoint_id, url in targets:
        session.add(
            WebhookDelivery(
                id=uuid.uuid4().hex, event_id=event.id, tenant_id=tenant,
                endpoint_id=endpoint_id, url=url, status=PENDING, attempts=0, attempt_log=[],
                next_attempt_at=now, created_at=now,
            )
        )  # fmt: skip
    return event


def subscribed(session: Session, tenant: str, type_: str) -> list[WebhookEndpoint]:
    """The tenant's live endpoints that want `type_`."""
    live = session.scalars(
        select(WebhookEndpoint).where(
            WebhookEndpoint.tenant_id == tenant,
            WebhookEndpoint.deleted_at.is_(None),
            WebhookEndpoint.disabled_at.is_(None),
        )
    )
    return [e for e in live if type_ in e.events]


def fail_pending(session: Session, endpoint_id: str, why: str) -> None:
    """An endpoint that will receive nothing more (deleted, disabled): its pending deliveries
    end failed, their history kept."""
    session.execute(
        update(WebhookDelivery)
        .where(WebhookDelivery.endpoint_id == endpoint_id, WebhookDelivery.status == PENDING)
        .values(status=FAILED, finished_at=utcnow(), last_error=why)
    )


def job_ended(session: Session, job_id: str, status: str, event: dict[str, Any]) -> None:
    """The webhook for a job that reached `status` (from jobs.add_event, in its transaction)."""
    job = session.get(Job, job_id)
    if job is None:
        return
    kind = KINDS[job.kind]
    data: dict[str, Any] = {"id": job.id, "object": job.kind, "status": status}
    links = {"self": f"/v1/{kind.collection}/{job.id}"}
    if artifact_id := event.get("artifact_id"):
        data["artifact_id"] = artifact_id
        links["artifact"] = f"/v1/artifacts/{artifact_id}"
    if code := event.get("code"):
        data["error_code"] = code
    if job.sweep_id:
        data["sweep_id"] = job.sweep_id
    data["links"] = links
    emit(
        session, tenant=job.tenant_id, type_=kind.webhook_event.format(status=status),
        subject_id=job.id, data=data, one_off_url=job.request.get("webhook"),
    )  # fmt: skip


def sweep_ended(session: Session, tenant: str, sweep_id: str, status: str) -> None:
    data = {
        "id": sweep_id, "object": "sweep", "status": status,
        "links": {"self": f"/v1/sweeps/{sweep_id}",
                  "leaderboard": f"/v1/sweeps/{sweep_id}/leaderboard"},
    }  # fmt: skip
    emit(session, tenant=tenant, type_="sweep.completed", subject_id=sweep_id, data=data)


def artifact_published(
    session: Session, job: Job, artifact_id: str, published: dict[str, Any]
) -> None:
    data = {
        "id": artifact_id, "object": "artifact", "job_id": job.id,
        "repo": published.get("repo"), "branch": published.get("branch"),
        "commit": published.get("commit"),
        "links": {"self": f"/v1/artifacts/{artifact_id}", "job": f"/v1/merges/{job.id}"},
    }  # fmt: skip
    emit(
        session, tenant=job.tenant_id, type_="artifact.published", subject_id=job.id,
        data=data, one_off_url=job.request.get("webhook"),
    )  # fmt: skip
