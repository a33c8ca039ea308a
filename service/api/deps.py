"""Dependencies shared by the routes, as Annotated aliases so routes read like prose."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Header, Request
from starlette.concurrency import run_in_threadpool

from core.db.session import Database
from core.jobs import Executor, ensure_tenant
from core.settings import Settings
from service.api.answers import KeptAnswers
from service.api.row_reads import BatchedRows, LoopRows
from service.api.streams import StreamSlots
from service.auth import KeyCache, tenant_of_hash
from service.operator import check_operator


@dataclass
class Context:
    settings: Settings
    db: Database
    executor: Executor
    streams: StreamSlots = field(init=False)
    tenants_made: set[str] = field(default_factory=set)  # rows known to exist (never deleted)
    answers: KeptAnswers = field(default_factory=KeptAnswers)  # GET /v1/<kind>/{id}
    rows: LoopRows | BatchedRows = field(init=False)  # how GET answers read their job's row
    keys: KeyCache = field(init=False)  # API key -> tenant, remembered briefly (service/auth.py)

    def __post_init__(self) -> None:
        self.streams = StreamSlots(self.settings.sse_streams_per_tenant)
        self.rows = LoopRows(self.db) if self.db.is_sqlite else BatchedRows(self.db)
        self.keys = KeyCache(lambda key_hash: run_in_threadpool(tenant_of_hash, self.db, key_hash))

    def close(self) -> None:
        self.rows.dispose()


async def get_context(request: Request) -> Context:
    # async: a sync dependency would cost a hop to the thread pool on every request
    context: Context = request.app.state.context
    return context


ContextDep = Annotated[Context, Depends(get_context)]


async def current_tenant(
    context: ContextDep, authorization: Annotated[str | None, Header()] = None
) -> str:
    """The request's tenant: by its API key (remembered for at most auth.KEY_CACHE_S, so a
    revoked key is refused within that), or the default one, whose row is made once per
    process."""
    if not context.settings.auth:
        tenant = context.settings.default_tenant
        if tenant not in context.tenants_made:
            await run_in_threadpool(ensure_tenant, context.db, tenant)
            context.tenants_made.add(tenant)
        return tenant
    return await context.keys.tenant(authorization)


TenantDep = Annotated[str, Depends(current_tenant)]


async def operator_if_auth(
    context: ContextDep, authorization: Annotated[str | None, Header()] = None
) -> None:
    """For routes that are no tenant's but the whole service's (metrics): with auth on, the
    operator token (service/operator.py), never a tenant's API key."""
    if context.settings.auth:
        check_operator(context.settings.metrics_token, authorization)


OperatorDep = Depends(operator_if_auth)
