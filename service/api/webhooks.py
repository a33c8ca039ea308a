"""/v1/webhooks: a tenant's endpoints (the secret shown once, at creation and rotation), their
deliveries with every attempt, replays, and the secret that signs one-off webhooks."""

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
    shown again."""
    endpoint = ep.create_endpoint(context.db, context.settings, tenant, body)
    response.headers["Location"] = f"/v1/webhooks/{endpoint.id}"
    return ep.endpoint_view(endpoint, secret=True)


@router.get("")
def list_webhooks(context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    return {"items": [ep.endpoint_view(e) for e in ep.list_endpoints(context.db, tenant)]}


@router.get("/secret")
def one_off_secret(context: ContextDep, tenant: TenantDep) -> dict[str, str]:
    """The secret that signs one-off webhooks (a merge's own `webhook` URL)."""
    return {"secret": ep.one_off_secret(context.db, tenant)}


@router.get("/deliveries")
def list_all_deliveries(
    context: ContextDep,
    tenant: TenantDep,
    subject_id: Annotated[str | None, Query(max_length=32, description="a job or sweep id")] = None,
    status: DeliveryStatus | None = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    """Every delivery of the tenant, one-off ones included, newest first."""
    found = ep.list_deliveries(
        context.db, tenant, subject_id=subject_id, status=status, limit=limit
    )
    return {"items": found}


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
def rotate_secret(endpoint_id: str, context: ContextDep, tenant: TenantDep) -> dict[str, Any]:
    """A new secret, shown once; every attempt from now on is signed with it."""
    return ep.endpoint_view(ep.rotate_secret(context.db, tenant, endpoint_id), secret=True)


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
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
) -> dict[str, Any]:
    ep.get_endpoint(context.db, tenant, endpoint_id)
    found = ep.list_deliveries(
        context.db, tenant, endpoint_id=endpoint_id, status=status, limit=limit
    )
    return {"items": found}
