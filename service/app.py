"""create_app(settings, executor=...): the FastAPI application with its store and the executor
its caller chose (layerswap/app.py: local or celery).

The API's description (/docs, /redoc, /openapi.json, and /v1/methods in meta.py) answers without
a key, auth on or off: it is made from the code alone, the same for every deployment and tenant,
and a client reads it before it holds a key. So do the web console's static files (/ui/,
service/api/console.py). Every other route needs a tenant's key, /metrics and
/v1/executor the operator's token (tests/service/test_api_security.py enumerates the routes)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Protocol

from fastapi import FastAPI

from core.changes import Listener
from core.db.session import Database
from core.hub import timeouts as hub_timeouts
from core.jobs import Executor
from core.settings import Settings
from service.api import (
    analyses,
    artifacts,
    console,
    errors,
    evaluations,
    jobs,
    merges,
    meta,
    monitor,
    reference,
    sweeps,
    webhooks,
)
from service.api.deps import Context
from service.api.middleware import RequestGuard
from service.collector import LongLivedFreezer
from service.reconciler import Reconciler
from service.webhooks.delivery import Deliverer


def create_app(settings: Settings, *, executor: Executor, db: Database | None = None) -> FastAPI:
    """The app, running jobs through `executor` and owning `db` (made from settings when not
    given; disposed at shutdown). The schema must already be migrated (`layerswap db upgrade`;
    `serve` does it)."""
    db = db or Database(settings.database)
    hub_timeouts.configure(settings.hub_timeout_s, settings.hub_min_bytes_per_s)  # submit pins
    context = Context(settings=settings, db=db, executor=executor)
    background: list[_Background] = [Reconciler(db, settings, executor), Deliverer(db, settings)]
    # Other processes' job changes (Celery workers, other API processes) wake this one's waiters.
    if not db.is_sqlite:
        background.append(Listener(settings.database))
    # Last: everything made before it starts (the imported libraries) lives as long as the
    # process, and so do the modules a first merge imports: frozen, full collections no longer
    # walk them.
    background.append(LongLivedFreezer())
    app = FastAPI(
        title="Layerswap",
        version="0.1.0",
        description="Merge fine-tuned LLM checkpoints on demand: layer swapping, soups, "
        "task arithmetic, TIES.",
        lifespan=_lifespan(context, background),
        docs_url=None,  # /docs and /redoc are reference.py's: no CDN, a policy of their own
        redoc_url=None,
    )
    app.state.context = context
    errors.install(app)
    # Outside routing: Host, Origin, media type and body size are checked before a body is
    # parsed or a key looked up.
    app.add_middleware(RequestGuard, settings=settings)
    # POST /v1/merges takes the recipes of the methods registered now (engine.methods.register)
    app.include_router(jobs.router)
    app.include_router(merges.submit_router())
    for module in (merges, artifacts, analyses, evaluations, sweeps, webhooks, meta, monitor):
        app.include_router(module.router)
    app.router.routes.append(console.mount())  # the web console: static files, no key
    reference.install(app)
    return app


class _Background(Protocol):
    def start(self) -> None: ...

    def stop(self) -> None: ...


def _lifespan(
    context: Context, background: list[_Background]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The executor, then `background` in order, started with the app; stopped in reverse at
    its end, then the context and the database let go."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        context.executor.start()
        for part in background:
            part.start()
        yield
        for part in reversed(background):
            part.stop()
        context.executor.stop()
        context.close()
        context.db.dispose()

    return lifespan
