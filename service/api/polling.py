"""Cheap, patient reads of one job.

Each read is one keyed SELECT of the job's row (service/api/row_reads.py); the answer made from
an equal row is sent again (service/api/answers.py), else it is made anew, serialised by
pydantic's JSON encoder (no second validation by FastAPI). It carries a weak ETag of its
content less the ETA; `If-None-Match` with the current ETag is a
304 without a body. Long polling (`?wait=N` or `Prefer: wait=N`, N ≤ 60 s) holds the request
until the job's answer differs from the client's ETag (or, with none, from what it was when the
request came), the job ends, or N seconds pass — woken by the change notifications of
core/changes.py, not by polling the database."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
from collections.abc import Awaitable, Callable, Sequence
from typing import Annotated, Any

from anyio import CapacityLimiter, to_thread
from fastapi import Query, Request, Response

from core import jobs
from core.changes import CHANGES
from core.db.models import Job
from core.errors import NotFound
from core.job_rows import ID, KIND, TENANT, driver_processors, job_of, processed
from core.jobs import is_id
from service.api.answers import Kept, answer
from service.api.deps import Context
from service.schemas import JobView

MAX_WAIT_S = 60.0
# Job reads are short, and a few threads do them faster than many: the request pool's 40
# threads mostly contend for the GIL (measured with 100 pollers on 2 cores: 40 threads 584
# polls/s, 4 threads 949). Slow handlers (a submit pinning Hub sources) keep the big pool.
READ_THREADS = max(4, 2 * (os.cpu_count() or 1))


def _readers(request: Request) -> CapacityLimiter:
    """The app's limiter for job reads, made in its event loop on first use."""
    state = request.app.state
    if getattr(state, "job_readers", None) is None:
        state.job_readers = CapacityLimiter(READ_THREADS)
    limiter: CapacityLimiter = state.job_readers
    return limiter


WaitQuery = Annotated[
    float | None,
    Query(ge=0, le=MAX_WAIT_S, description="long poll: hold the answer up to this many seconds"),
]
CONDITIONAL: dict[int | str, dict[str, Any]] = {
    304: {"description": "unchanged: If-None-Match holds the current ETag"}
}
_PREFER_WAIT = re.compile(r"(?:^|[,;\s])wait\s*=\s*([0-9]+(?:\.[0-9]+)?)", re.IGNORECASE)


def wait_seconds(request: Request, wait: float | None) -> float:
    """?wait= wins over `Prefer: wait=` (RFC 7240); at most MAX_WAIT_S."""
    if wait is None:
        match = _PREFER_WAIT.search(request.headers.get("prefer", ""))
        wait = float(match.group(1)) if match else 0.0
    return max(0.0, min(wait, MAX_WAIT_S))


def _matches(header: str | None, etag: str) -> bool:
    if header is None:
        return False
    tags = {t.strip().removeprefix("W/") for t in header.split(",")}
    return header.strip() == "*" or etag.removeprefix("W/") in tags


async def read_job(
    request: Request,
    context: Context,
    *,
    tenant: str,
    job_id: str,
    kind: str,
    view: Callable[[Job], JobView],
    wait: float | None,
    reusable: Callable[[Job], bool] | None = None,
) -> Response:
    """GET /v1/<kind's collection>/{id}: the job as `view` shows it, conditionally (below).
    `reusable(job)`: whether the view shows nothing but the job's row and its output
    artifact's, so that its answer may be given again while that row reads back the same
    (service/api/answers.py); without it, every read makes the view anew."""
    if not is_id(job_id):
        raise NotFound(f"no such job: {job_id}")
    limiter = _readers(request)

    async def read() -> Kept:
        row = await context.rows.read(job_id)
        if row is None or row[TENANT] != tenant or row[KIND] != kind:  # before any answer
            raise NotFound(f"no such job: {job_id}")
        found = context.answers.get(job_id, row)
        if found is not None:
            return found
        return await to_thread.run_sync(answer_for, context, row, view, reusable, limiter=limiter)

    return await conditional_read(request, job_id, read, wait)


def answer_for(
    context: Context,
    row: Sequence[Any],
    view: Callable[[Job], JobView],
    reusable: Callable[[Job], bool] | None,
) -> Kept:
    """The answer to a read of the job whose row (core/job_rows.py, the driver's values)
    is `row`: the one kept for an equal row, else made from this one (and kept when
    `reusable`, as read_job says). Blocking (the view may read other rows)."""
    job_id = row[ID]
    found = context.answers.get(job_id, row)
    if found is not None:
        return found
    job = job_of(processed(row, driver_processors(context.db.engine.dialect)))
    made = answer(view(job))
    fresh = Kept(row, made, job.status in jobs.TERMINAL)
    if reusable is not None and made.timeless and reusable(job):
        context.answers.put(job_id, fresh)
    return fresh


async def answers_for(
    context: Context,
    rows: Sequence[Sequence[Any]],
    view: Callable[[Job], JobView],
    reusable: Callable[[Job], bool] | None,
) -> list[bytes]:
    """answer_for each row, their JSON: given from those kept on the event loop when all are,
    else made on a thread (a view may read other rows)."""
    kept = [context.answers.get(row[ID], row) for row in rows]
    if all(found is not None for found in kept):
        return [found.answer.body for found in kept if found is not None]
    made = await to_thread.run_sync(
        lambda: [answer_for(context, row, view, reusable).answer.body for row in rows]
    )
    return made


def page_body(items: Sequence[bytes], next_cursor: str | None) -> bytes:
    """The JSON of a page of answers (schemas.JobPage) from each item's own JSON."""
    cursor = json.dumps(next_cursor).encode()
    return b'{"items":[' + b",".join(items) + b'],"next_cursor":' + cursor + b"}"


async def conditional_read(
    request: Request,
    job_id: str,
    read: Callable[[], Awaitable[Kept]],
    wait: float | None,
) -> Response:
    """`read()` -> the job's answer, its ETag and whether it has ended."""
    seconds = wait_seconds(request, wait)
    asked = request.headers.get("if-none-match")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    baseline: str | None = None
    while True:
        future = CHANGES.subscribe(job_id) if seconds > 0 else None
        try:
            found = await read()
            etag = found.etag
            if baseline is None:
                baseline = etag
            unchanged = _matches(asked, etag) if asked is not None else etag == baseline
            remaining = deadline - loop.time()
            if future is None or found.ended or not unchanged or remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout=remaining)
        finally:
            if future is not None:
                CHANGES.unsubscribe(job_id, future)
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if _matches(asked, etag):
        return Response(status_code=304, headers=headers)
    return Response(content=found.answer.body, media_type="application/json", headers=headers)
