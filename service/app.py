"""create_app(settings): the FastAPI application with its store and executor.

The API's description (/docs, /redoc, /openapi.json, and /v1/methods in meta.py) answers without
a key, auth on or off: it is made from the code alone, the same for every deployment and tenant,
and a client reads it before it holds a key. Every other route needs a tenant's key, /metrics the
operator's token (tests/service/test_api_security.py enumerates the routes)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from service.api import (
    analyses,
    artifacts,
    errors,
    evaluations,
    merges,
    meta,
    sweeps,
    webhooks,
)
from service.api.deps import Context
from service.api.middleware import RequestGuard
from service.changes import Listener
from service.collector import LongLivedFreezer
from service.db.session import Database
from service.jobs import Executor
from service.reconciler import Reconciler
from service.settings import Settings
from service.webhooks.delivery import Deliverer
from worker.hub import timeouts as hub_timeouts


def make_executor(db: Database, settings: Settings) -> Executor:
    from worker.executors import CeleryExecutor, LocalExecutor

    if settings.executor == "celery":
        return CeleryExecutor(settings)
    return LocalExecutor(db, settings)


def create_app(settings: Settings, *, executor: Executor | None = None) -> FastAPI:
    """The schema must already be migrated (`layerswap db upgrade`; `serve` does it)."""
    db = Database(settings.database)
    hub_timeouts.configure(settings.hub_timeout_s, settings.hub_min_bytes_per_s)  # submit pins
    if executor is None:
        executor = make_executor(db, settings)
    context = Context(settings=settings, db=db, executor=executor)
    reconciler = Reconciler(db, settings, executor)
    deliverer = Deliverer(db, settings)
    # Other processes' job changes (Celery workers, other API processes) wake this one's waiters.
    listener = None if db.is_sqlite else Listener(settings.database)
    freezer = LongLivedFreezer()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        context.executor.start()
        reconciler.start()
        deliverer.start()
        if listener is not None:
            listener.start()
        # Everything made so far (the imported libraries) lives as long as the process, and so
        # do the modules a first merge imports: frozen, full collections no longer walk them.
        freezer.start()
        yield
        freezer.stop()
        if listener is not None:
            listener.stop()
        deliverer.stop()
        reconciler.stop()
        context.executor.stop()
        context.close()
        db.dispose()

    app = FastAPI(
        title="Layerswap",
        version="0.1.0",
        description="Merge fine-tuned LLM checkpoints on demand: layer swapping, soups, "
        "task arithmetic, TIES.",
        lifespan=lifespan,
    )
    app.state.context = context
    errors.install(app)
    # Outside routing: Host, Origin, media type and body size are checked before a body is
    # parsed or a key looked up.
    app.add_middleware(RequestGuard, settings=settings)
    for module in (merges, artifacts, analyses, evaluations, sweeps, webhooks, meta):
        app.include_router(module.router)
    return app


def app_from_environment() -> FastAPI:
    """The app from LAYERSWAP_* alone: what each process of `layerswap serve --workers N` runs
    (the schema is migrated once, by `serve`, before they start)."""
    return create_app(Settings())
