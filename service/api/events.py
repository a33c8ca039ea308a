"""GET /v1/<kind>/{id}/events: a job's event log, as JSON or as Server-Sent Events, for every
kind of job (merges, evaluations, analyses)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Query, Request, Response

from core import jobs
from core.changes import CHANGES
from core.db.models import as_utc
from service.api.deps import Context, ContextDep, TenantDep
from service.api.errors import error_response
from service.api.streams import SlotStreamingResponse
from service.exposure import exposure_for
from service.schemas import EventRead

SSE_WAKE_S = 2.0  # an event stream re-reads at least this often, woken or not
SSE_RECONNECT_MS = 1000  # the `retry:` hint: how soon a client reconnects after a stream ends
SSE_RETRY_AFTER_S = 5  # Retry-After of a 429 for too many open streams
MAX_EVENT_ID = 2**63 - 1  # larger ids cannot be compared in SQLite (OverflowError)


def add_events_route(router: APIRouter, *, kind: str) -> None:
    """GET {router's prefix}/{job_id}/events for the jobs of `kind`. Added before a route
    whose path would match it too (`/{job_id}/{filename}`)."""

    def job_events(
        job_id: str,
        request: Request,
        context: ContextDep,
        tenant: TenantDep,
        last_event_id: Annotated[int | None, Header(ge=0, le=MAX_EVENT_ID)] = None,
        after: Annotated[int, Query(ge=0, le=MAX_EVENT_ID)] = 0,
    ) -> list[EventRead] | Response:
        """The job's event log, oldest first, after event `after` (or Last-Event-ID); as
        Server-Sent Events for `Accept: text/event-stream`. A stream ends after
        `sse_max_seconds` (resume with Last-Event-ID); a tenant may hold at most
        `sse_streams_per_tenant` open in one API process."""
        jobs.get(context.db, tenant=tenant, job_id=job_id, kind=kind)
        start = last_event_id if last_event_id is not None else after
        if "text/event-stream" in request.headers.get("accept", ""):
            return _stream_response(context, tenant, job_id, start, request)
        found = jobs.events(context.db, tenant=tenant, job_id=job_id, after=start)
        shown = exposure_for(context.settings)  # a failure's event carries its error
        return [
            EventRead(id=e.id, type=e.type, data=shown.value(e.data), created_at=e.created_at)
            for e in found
        ]

    router.add_api_route(
        "/{job_id}/events",
        job_events,
        methods=["GET"],
        name=f"{kind}_events",
        response_model=list[EventRead],
        responses={
            200: {"content": {"text/event-stream": {}}},
            429: {"description": "too many open event streams (too_many_streams)"},
        },
    )


def _stream_response(
    context: Context, tenant: str, job_id: str, after: int, request: Request
) -> Response:
    if not context.streams.take(tenant):
        return error_response(
            429,
            "too_many_streams",
            f"at most {context.streams.limit} event streams may be open at once; "
            "close one or poll GET .../events",
            retry_after=SSE_RETRY_AFTER_S,
        )
    return SlotStreamingResponse(
        _event_stream(context, tenant, job_id, after, request),
        release=lambda: context.streams.give_back(tenant),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


async def _event_stream(
    context: Context, tenant: str, job_id: str, after: int, request: Request
) -> AsyncIterator[str]:
    # A stream has a lifetime, so a slot cannot be held forever.
    deadline = time.monotonic() + context.settings.sse_max_seconds
    while not await request.is_disconnected():
        changed = CHANGES.subscribe(job_id)  # before reading: no change slips in between
        try:
            # The status first: a terminal status is committed with its event, so the events
            # read next include it, and the stream can end right after sending them.
            job = await asyncio.to_thread(jobs.get, context.db, tenant=tenant, job_id=job_id)
            found = await asyncio.to_thread(
                jobs.events, context.db, tenant=tenant, job_id=job_id, after=after
            )
            for event in found:
                after = event.id
                created = as_utc(event.created_at).isoformat()
                shown = exposure_for(context.settings).value(event.data)
                data = json.dumps({"type": event.type, **shown, "created_at": created})
                yield f"id: {event.id}\nevent: {event.type}\ndata: {data}\n\n"
            if job.status in jobs.TERMINAL:
                return
            if time.monotonic() >= deadline:
                # Not finished, only cut short: how soon to come back (an EventSource
                # reconnects by itself, sending its Last-Event-ID).
                yield f"retry: {SSE_RECONNECT_MS}\n\n"
                return
            # Pushed: woken by the job's next change (core/changes.py); the timeout is a
            # safety net, and notices a client that hung up.
            remaining = max(deadline - time.monotonic(), 0.0)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed, timeout=min(SSE_WAKE_S, remaining))
        finally:
            CHANGES.unsubscribe(job_id, changed)
