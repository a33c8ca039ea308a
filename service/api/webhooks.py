"""/v1/webhooks: a tenant's endpoints (the secret shown once, at creation and rotation; at most
LAYERSWAP_WEBHOOK_MAX_ENDPOINTS of them), their deliveries with every attempt, replays, and the
secret that signs one-off webhooks. Lists are pages: `limit`, and `next_cursor` to pass back as
`cursor` for the next one (null on the last)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response

from service.api.deps import ContextDep, TenantDep
from service.webhooks import endpoints as ep

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])
DeliveryStatus = Literal["pending", "delivered", "failed"]


@router.post("", status_code=201)
def create_webhook(
    body: ep.EndpointCreate, response: Response, context: ContextDep, tenant: TenantDep
) -> dict[str, Any]:
    """Subscribe `url` to `events`. The answer holds the signing secret (`whsec_…`): it is not
    shown again. A tenant at its limit of endpoints gets 409 `webhook_endpoint_limit`."""
    endpoint, secret = ep.create_endpoint(context.db, context.settings, tenant, body)
    response.headers["Location"] = f"/v1/webhooks/{endpoint.id}"
    return ep.endpoint_view(endpoint, secret=secret)


@router.get("")
def list_webhooks(
    context: ContextDep,
    tenant: TenantDep,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> dict[str, Any]:
    """Oldest first; cursor pagination."""
    found, next_cursor = ep.list_endpoints(context.db, tenant, cursor=cursor, limit=limit)
    return {"items": [ep.endpoint_view(e) for e in found], "next_cursor": next_cursor}


@router.get("/secret")
def one_off_secret(context: ContextDep, tenant: TenantDep) -> dict[str, str]:
    """The secret that signs one-off webhooks (a merge's own `webhook` URL)."""
    return {"secret": ep.one_off_secret(context.db, context.settings, tenant)}


@router.get("/deliveries")
def list_all_deliveries(
    context: ContextDep,
    tenant: TenantDep,
    subject_id: Annotated[str | None, Query(max_length=32, description="a job or sweep id")] = None,
    status: DeliveryStatus | None = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Every delivery of the tenant, one-off ones included, newest first; cursor pagination."""
    found, next_cursor = ep.list_deliveries(
        context.db, tenant, subject_id=subject_id, status=status, cursor=cursor, limit=limit
    )
    return {"items": found, "next_cursor": next_cursor}


@router.post("/deliveries/{delivery_id}/replay", status_code=202)
def replay_delivery(delivery_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """Send an ended delivery again now, with the same webhook-id."""
    return ep.replay(context.db, tenant, delivery_id)


@router.get("/{endpoint_id}")
def get_webhook(endpoint_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    return ep.endpoint_view(ep.get_endpoint(context.db, tenant, endpoint_id))


@router.delete("/{endpoint_id}", status_code=204)
def delete_webhook(endpoint_id: str, context: ContextDep, tenant: TenantDep) -> Response:
    ep.delete_endpoint(context.db, tenant, endpoint_id)
    return Response(status_code=204)


@router.post("/{endpoint_id}/rotate-secret")
def rotate_secret(
    endpoint_id: str,
    context: ContextDep,
    tenant: TenantDep,
    body: ep.SecretRotation | None = None,
) -> dict[str, Any]:
    """A new secret, shown once; every attempt from now on is signed with it, and with the old
    one too until `previous_secret_expires_at` (`overlap_s`, default
    LAYERSWAP_WEBHOOK_SECRET_OVERLAP_S): `webhook-signature` then carries both signatures, so
    receivers can switch secrets without refusing an event."""
    overlap = body.overlap_s if body is not None else None
    endpoint, secret = ep.rotate_secret(context.db, context.settings, tenant, endpoint_id, overlap)
    return ep.endpoint_view(endpoint, secret=secret)


@router.post("/{endpoint_id}/enable")
def enable_webhook(endpoint_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """Re-enable an endpoint disabled by a 410 Gone."""
    return ep.endpoint_view(ep.enable(context.db, tenant, endpoint_id))


@router.get("/{endpoint_id}/deliveries")
def list_deliveries(
    endpoint_id: str,
    context: ContextDep,
    tenant: TenantDep,
    status: DeliveryStatus | None = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Newest first; cursor pagination."""
    ep.get_endpoint(context.db, tenant, endpoint_id)
    found, next_cursor = ep.list_deliveries(
        context.db, tenant, endpoint_id=endpoint_id, status=status, cursor=cursor, limit=limit
    )
    return {"items": found, "next_cursor": next_cursor}
