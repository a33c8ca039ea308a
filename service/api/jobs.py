"""/v1/jobs: every kind in one list (merges, evaluations, analyses, and sweeps), newest first, as
short summaries: what a table of all of a tenant's work shows. Each kind's own route
(/v1/<kind>/{id}) gives the whole job."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query
from sqlalchemy import (
    JSON,
    ColumnElement,
    Select,
    String,
    and_,
    case,
    cast,
    func,
    literal,
    null,
    or_,
    true,
    tuple_,
    union_all,
)
from sqlalchemy import select as sql_select

from core import jobs
from core.cursors import decode_cursor, decode_sorted_cursor, encode_cursor, encode_sorted_cursor
from core.db.models import Job, Sweep, as_utc
from core.errors import InvalidRequest
from core.kinds import KINDS
from service.api.deps import Context, ContextDep, TenantDep
from service.api.meta import seconds_between
from service.exposure import exposure_for
from service.schemas import JobSummaryPage, error_view, progress_of

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

SWEEP = "sweep"
LISTED_KINDS = (*KINDS, SWEEP)
PAGE_LIMIT = 200
# Where each kind is read from a browser (the console) or a client: its own route.
COLLECTION = {"merge": "merges", "evaluation": "evaluations", "analysis": "analyses",
              SWEEP: "sweeps"}  # fmt: skip
_JOB_COLUMNS = ("bytes_done", "bytes_total", "tensors_done", "tensors_total", "started_at")
# Each kind's `method`: the field of its request a list shows beside it (a merge's method, an
# evaluation's first task, an analysis's base model, a sweep's objective task).
METHOD_FIELD: dict[str, tuple[str | int, ...]] = {
    "merge": ("method",),
    "evaluation": ("evaluation", "tasks", 0),
    "analysis": ("base",),
    SWEEP: ("objective", "task"),
}
SORTS = ("created_at", "kind", "name", "status", "method", "duration")
NOT_ENDED = -1.0  # the duration a job that has not ended sorts by: below every ended one


@dataclass(frozen=True)
class Listing:
    """What a page lists (the filters) and in which order; `dialect` for the SQL of durations."""

    tenant: str
    kind: str | None
    status: str | None
    q: str | None
    sort: str
    descending: bool
    dialect: str


Position = tuple[Any, ...]  # (sort key, created_at, id), or (created_at, id) by created_at


@router.get("", response_model=JobSummaryPage)
def list_all_jobs(
    context: ContextDep,
    tenant: TenantDep,
    kind: Literal[LISTED_KINDS] | None = None,  # type: ignore[valid-type]
    status: Annotated[Literal[jobs.STATUSES] | None, Query()] = None,  # type: ignore[valid-type]
    q: Annotated[str | None, Query(max_length=200, description="in the id or name")] = None,
    sort: Annotated[Literal[SORTS], Query(description="the order's field")] = "created_at",  # type: ignore[valid-type]
    order: Literal["asc", "desc"] = "desc",
    cursor: Annotated[str | None, Query(description="the page after this position")] = None,
    before: Annotated[str | None, Query(description="the page before this position")] = None,
    limit: Annotated[int, Query(ge=1, le=PAGE_LIMIT)] = 50,
) -> dict[str, Any]:
    """Newest first unless `sort`/`order` say otherwise; filter by kind, status, and text in
    the id or the name; cursor pagination both ways (keyset on the sort key, created_at and
    id: a page costs the rows it shows); `total` counts every job the filters match."""
    if cursor and before:
        raise InvalidRequest("before: give cursor or before, not both", details={"field": "before"})
    dialect = context.db.engine.dialect.name
    listing = Listing(tenant, kind, status, q, sort, order == "desc", dialect)
    position = _position(sort, before or cursor, "before" if before else "cursor")
    backwards = before is not None
    with context.db.session() as session:
        query = _page(listing, position, backwards, limit + 1)
        rows = [dict(row._mapping) for row in session.execute(query)]
        total = sum(session.execute(count).scalar_one() for count in _counts(listing))
    more = len(rows) > limit
    del rows[limit:]
    if backwards:
        rows.reverse()
    after_last = more if not backwards else bool(rows)
    before_first = (more if backwards else cursor is not None) and bool(rows)
    progress = _sweep_progress(context, [row["id"] for row in rows if row["kind"] == SWEEP])
    shown = exposure_for(context.settings)
    return {
        "items": [shown.value(_summary(row, progress)) for row in rows],
        "total": total,
        "next_cursor": _cursor(sort, rows[-1]) if after_last else None,
        "prev_cursor": _cursor(sort, rows[0]) if before_first else None,
    }


def _position(sort: str, cursor: str | None, field: str) -> Position | None:
    if not cursor:
        return None
    try:
        if sort == "created_at":
            return decode_cursor(cursor)
        value, created_at, row_id = decode_sorted_cursor(cursor, sort)
        return (float(value) if sort == "duration" else value), created_at, row_id
    except (InvalidRequest, ValueError) as e:
        message = f"{field}: not a cursor from this API for sort={sort}"
        raise InvalidRequest(message, details={"field": field}) from e


def _cursor(sort: str, row: dict[str, Any]) -> str:
    if sort == "created_at":
        return encode_cursor(row["created_at"], row["id"])
    value = repr(float(row[sort])) if sort == "duration" else str(row[sort])
    return encode_sorted_cursor(sort, value, row["created_at"], row["id"])


def _page(listing: Listing, position: Position | None, backwards: bool, count: int) -> Select[Any]:
    """The `count` rows after `position` in the listing's order (before it, nearest first, when
    `backwards`). Each table's first `count` (an index walk each for the default order), then
    the first of those: the page never sorts the whole list."""
    descending = listing.descending != backwards
    parts = [
        sql_select(_ordered(part.where(_after(columns, listing.sort, position, descending)),
                            listing.sort, descending, count).subquery())
        for part, columns in _parts(listing)
    ]  # fmt: skip
    listed = union_all(*parts).subquery() if len(parts) > 1 else parts[0].subquery()
    return _ordered(sql_select(listed), listing.sort, descending, count)


def _counts(listing: Listing) -> list[Select[Any]]:
    """One COUNT per table of the rows the listing's filters match."""
    return [sql_select(func.count()).select_from(part.subquery()) for part, _ in _parts(listing)]


def _ordered(query: Select[Any], sort: str, descending: bool, count: int) -> Select[Any]:
    """The first `count` rows of `query` by (sort key, created_at, id). A member of a UNION
    must be wrapped once more: SQLite takes no ORDER BY or LIMIT on one."""
    inner = query.subquery()
    keys = [inner.c[name] for name in _keys(sort)]
    ordered = sql_select(inner).order_by(*(k.desc() if descending else k.asc() for k in keys))
    return ordered.limit(count)


def _keys(sort: str) -> tuple[str, ...]:
    return ("created_at", "id") if sort == "created_at" else (sort, "created_at", "id")


def _after(
    columns: dict[str, Any], sort: str, position: Position | None, descending: bool
) -> ColumnElement[bool]:
    if position is None:
        return true()
    keys = tuple_(*(columns[name] for name in _keys(sort)))
    return keys < tuple_(*position) if descending else keys > tuple_(*position)


def _parts(listing: Listing) -> list[tuple[Select[Any], dict[str, Any]]]:
    """Each table's filtered rows (jobs, sweeps, or both) with the columns they select."""
    parts = []
    if listing.kind != SWEEP:
        parts.append(_job_rows(listing))
    if listing.kind in (None, SWEEP):
        parts.append(_sweep_rows(listing))
    return parts


def _filters(columns: Any, listing: Listing) -> list[ColumnElement[bool]]:
    found = [columns.tenant_id == listing.tenant]
    if listing.status:
        found.append(columns.status == listing.status)
    return found


def _text(column: Any, text: str) -> ColumnElement[bool]:
    pattern = "%" + text.lower().replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_")
    return func.lower(column).like(pattern + "%", escape="\\")


def _method(request: Any, kinds: dict[str, tuple[str | int, ...]]) -> ColumnElement[str]:
    """The request's METHOD_FIELD for its kind, as text ('' when it has none)."""
    paths = [(kind, request[path].as_string()) for kind, path in kinds.items()]
    return func.coalesce(paths[0][1] if len(paths) == 1 else _by_kind(paths), "")


def _by_kind(paths: list[tuple[str, ColumnElement[str]]]) -> ColumnElement[str]:
    return case(*((Job.kind == kind, path) for kind, path in paths))


def _selected(columns: dict[str, Any], where: list[ColumnElement[bool]]) -> Select[Any]:
    return sql_select(*(c.label(name) for name, c in columns.items())).where(and_(*where))


def _job_rows(listing: Listing) -> tuple[Select[Any], dict[str, Any]]:
    where = _filters(Job, listing)
    if listing.kind:
        where.append(Job.kind == listing.kind)
    if listing.q:
        q = listing.q
        where.append(or_(Job.id.startswith(q.lower(), autoescape=True), _text(Job.output_name, q)))
    kinds = {k: p for k, p in METHOD_FIELD.items() if k in KINDS and listing.kind in (None, k)}
    duration = seconds_between(listing.dialect, Job.started_at, Job.finished_at)
    columns: dict[str, Any] = {
        "id": Job.id, "kind": Job.kind, "status": Job.status, "stage": Job.stage,
        "name": Job.output_name, **{c: getattr(Job, c) for c in _JOB_COLUMNS},
        "finished_at": Job.finished_at, "error": Job.error, "sweep_id": Job.sweep_id,
        "created_at": Job.created_at, "method": _method(Job.request, kinds),
        "duration": func.coalesce(duration, NOT_ENDED),
    }  # fmt: skip
    return _selected(columns, where), columns


def _sweep_rows(listing: Listing) -> tuple[Select[Any], dict[str, Any]]:
    where = _filters(Sweep, listing)
    if listing.q:
        where.append(Sweep.id.startswith(listing.q.lower(), autoescape=True))
    zero = literal(0)
    duration = seconds_between(listing.dialect, Sweep.created_at, Sweep.finished_at)
    columns: dict[str, Any] = {
        "id": Sweep.id, "kind": literal(SWEEP, String), "status": Sweep.status,
        "stage": cast(null(), String), "name": literal("", String),
        "bytes_done": zero, "bytes_total": zero, "tensors_done": zero, "tensors_total": zero,
        "started_at": Sweep.created_at, "finished_at": Sweep.finished_at,
        "error": cast(null(), JSON), "sweep_id": cast(null(), String),
        "created_at": Sweep.created_at,
        "method": _method(Sweep.request, {SWEEP: METHOD_FIELD[SWEEP]}),
        "duration": func.coalesce(duration, NOT_ENDED),
    }  # fmt: skip
    return _selected(columns, where), columns


def _sweep_progress(context: Context, sweep_ids: list[str]) -> dict[str, tuple[int, int]]:
    """(jobs ended, jobs) of each sweep: one grouped count for the page."""
    if not sweep_ids:
        return {}
    query = (
        sql_select(
            Job.sweep_id,
            func.count(),
            func.sum(case((Job.status.in_(jobs.TERMINAL), 1), else_=0)),
        )
        .where(Job.sweep_id.in_(sweep_ids))
        .group_by(Job.sweep_id)
    )
    with context.db.session() as session:
        return {row[0]: (int(row[2] or 0), int(row[1])) for row in session.execute(query)}


def _summary(row: dict[str, Any], sweeps: dict[str, tuple[int, int]]) -> dict[str, Any]:
    kind = row["kind"]
    if kind == SWEEP:
        ended, total = sweeps.get(row["id"], (0, 0))
        fraction = 1.0 if row["status"] == jobs.SUCCEEDED else (ended / total if total else 0.0)
        progress: dict[str, Any] = {"unit": "jobs", "done": ended, "total": total,
                                    "fraction": round(fraction, 6)}  # fmt: skip
    else:
        found = progress_of({**row, "kind": kind})
        progress = {key: found[key] for key in ("unit", "done", "total", "fraction", "eta_s")}
    error = row["error"]
    return {
        "id": row["id"],
        "kind": kind,
        "status": row["status"],
        "stage": row["stage"],
        "name": row["name"] or None,
        "progress": progress,
        "error": error_view(error) if error else None,
        "sweep_id": row["sweep_id"],
        "method": row["method"] or None,
        "created_at": as_utc(row["created_at"]),
        "started_at": as_utc(row["started_at"]) if row["started_at"] else None,
        "finished_at": as_utc(row["finished_at"]) if row["finished_at"] else None,
        "duration_s": None if row["duration"] == NOT_ENDED else row["duration"],
        "url": f"/v1/{COLLECTION[kind]}/{row['id']}",
    }
