"""Cheap, patient reads of one job.

The answer is serialised by pydantic's JSON encoder (no second validation by FastAPI) and
carries a weak ETag of its content less the ETA; `If-None-Match` with the current ETag is a
304 without a body. Long polling (`?wait=N` or `Prefer: wait=N`, N ≤ 60 s) holds the request
until the job's answer differs from the client's ETag (or, with none, from what it was when the
request came), the job ends, or N seconds pass — woken by the change notifications of
service/changes.py, not by polling the database."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from anyio import CapacityLimiter, to_thread
from fastapi import Query, Request, Response
from pydantic import BaseModel

from service import jobs
from service.api.deps import Context
from service.changes import CHANGES
from service.db.models import Job

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


@dataclass(frozen=True)
class Answer:
    body: bytes  # the JSON sent
    version: bytes  # what the ETag covers: the body less what changes with the clock alone


def answer(view: BaseModel) -> Answer:
    """A job view's JSON, and its version without the ETA (which moves as time passes: an ETag
    over it would change on every read, and a long poll would never wait)."""
    body = view.model_dump_json().encode()
    progress = getattr(view, "progress", None)
    if getattr(progress, "eta_s", None) is None:  # no ETA (every ended job): one dump
        return Answer(body, body)
    return Answer(body, view.model_dump_json(exclude={"progress": {"eta_s"}}).encode())


def etag_of(version: bytes) -> str:
    """Weak: equal versions may differ in their ETA."""
    return 'W/"' + hashlib.blake2b(version, digest_size=12).hexdigest() + '"'


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
    view: Callable[[Job], BaseModel],
    wait: float | None,
) -> Response:
    """GET /v1/<kind's collection>/{id}: the job as `view` shows it, conditionally (below)."""

    def read() -> tuple[Answer, bool]:
        job = jobs.get(context.db, tenant=tenant, job_id=job_id, kind=kind)
        return answer(view(job)), job.status in jobs.TERMINAL

    return await conditional_read(request, job_id, read, wait)


async def conditional_read(
    request: Request,
    job_id: str,
    read: Callable[[], tuple[Answer, bool]],
    wait: float | None,
) -> Response:
    """`read()` -> (the job's answer, whether it has ended), run on the job readers' threads."""
    seconds = wait_seconds(request, wait)
    asked = request.headers.get("if-none-match")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    baseline: str | None = None
    while True:
        future = CHANGES.subscribe(job_id) if seconds > 0 else None
        try:
            found, ended = await to_thread.run_sync(read, limiter=_readers(request))
            etag = etag_of(found.version)
            if baseline is None:
                baseline = etag
            unchanged = _matches(asked, etag) if asked is not None else etag == baseline
            remaining = deadline - loop.time()
            if future is None or ended or not unchanged or remaining <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(future, timeout=remaining)
        finally:
            if future is not None:
                CHANGES.unsubscribe(job_id, future)
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if _matches(asked, etag):
        return Response(status_code=304, headers=headers)
    return Response(content=found.body, media_type="application/json", headers=headers)
