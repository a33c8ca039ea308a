"""Dependencies shared by the routes, as Annotated aliases so routes read like prose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request

from service.api.streams import StreamSlots
from service.auth import tenant_for
from service.db.session import Database
from service.jobs import Executor, ensure_tenant
from service.settings import Settings


@dataclass
class Context:
    settings: Settings
    db: Database
    executor: Executor
    streams: StreamSlots = field(init=False)

    def __post_init__(self) -> None:
        self.streams = StreamSlots(self.settings.sse_streams_per_tenant)


def get_context(request: Request) -> Context:
    context: Context = request.app.state.context
    return context


ContextDep = Annotated[Context, Depends(get_context)]


def current_tenant(
    context: ContextDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    if not context.settings.auth:
        ensure_tenant(context.db, context.settings.default_tenant)
        return context.settings.default_tenant
    return tenant_for(context.db, authorization)


TenantDep = Annotated[str, Depends(current_tenant)]


def api_key_if_auth(
    context: ContextDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """For routes that are not a tenant's (metrics): with auth on, any valid key."""
    if context.settings.auth:
        tenant_for(context.db, authorization)


ApiKeyDep = Depends(api_key_if_auth)
