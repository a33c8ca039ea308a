"""/v1/jobs: every kind in one list (merges, evaluations, analyses, and sweeps), newest first, as
short summaries: what a table of all of a tenant's work shows. Each kind's own route
(/v1/<kind>/{id}) gives the whole job."""

from __future__ import annotations

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
    tuple_,
    union_all,
)
from sqlalchemy import select as sql_select

from core import jobs
from core.cursors import decode_cursor, encode_cursor
from core.db.models import Job, Sweep, as_utc
from core.kinds import KINDS
from service.api.deps import Context, ContextDep, TenantDep
from service.exposure import exposure_for
from service.schemas import error_view, progress_of

router = APIRouter(prefix="/v1/jobs", tags=["jobs"])

SWEEP = "sweep"
LISTED_KINDS = (*KINDS, SWEEP)
PAGE_LIMIT = 200
# Where each kind is read from a browser (the console) or a client: its own route.
COLLECTION = {"merge": "merges", "evaluation": "evaluations", "analysis": "analyses",
              SWEEP: "sweeps"}  # fmt: skip
_JOB_COLUMNS = ("bytes_done", "bytes_total", "tensors_done", "tensors_total", "started_at")


@router.get("")
def list_all_jobs(
    context: ContextDep,
    tenant: TenantDep,
    kind: Literal[LISTED_KINDS] | None = None,  # type: ignore[valid-type]
    status: Annotated[Literal[jobs.STATUSES] | None, Query()] = None,  # type: ignore[valid-type]
    q: Annotated[str | None, Query(max_length=200, description="in the id or name")] = None,
    cursor: str | None = None,
    limit: Annotated[int, Query(ge=1, le=PAGE_LIMIT)] = 50,
) -> dict[str, Any]:
    """Newest first; filter by kind, status, and text in the id or the name; cursor
    pagination (keyset on created_at and id: a page costs the rows it shows)."""
    after = decode_cursor(cursor) if cursor else None
    parts = []
    if kind != SWEEP:
        parts.append(_job_rows(tenant, kind, status, q, after))
    if kind in (None, SWEEP):
        parts.append(_sweep_rows(tenant, status, q, after))
    # Each table's newest limit + 1 first (an index walk each), then the newest of those: the
    # page never sorts the whole list.
    pages = [sql_select(_newest(part, limit + 1).subquery()) for part in parts]
    listed = union_all(*pages).subquery() if len(pages) > 1 else pages[0].subquery()
    query = _newest(sql_select(listed), limit + 1)
    with context.db.session() as session:
        rows = [dict(row._mapping) for row in session.execute(query)]
    next_cursor = None
    if len(rows) > limit:
        del rows[limit:]
        next_cursor = encode_cursor(rows[-1]["created_at"], rows[-1]["id"])
    progress = _sweep_progress(context, [row["id"] for row in rows if row["kind"] == SWEEP])
    shown = exposure_for(context.settings)
    return {
        "items": [shown.value(_summary(row, progress)) for row in rows],
        "next_cursor": next_cursor,
    }


def _newest(query: Select[Any], count: int) -> Select[Any]:
    """The `count` newest rows of `query` (by created_at, then id). A member of a UNION must
    be wrapped once more: SQLite takes no ORDER BY or LIMIT on one."""
    inner = query.subquery()
    ordered = sql_select(inner).order_by(inner.c.created_at.desc(), inner.c.id.desc())
    return ordered.limit(count)


def _filters(
    columns: Any, tenant: str, status: str | None, after: tuple[Any, str] | None
) -> list[ColumnElement[bool]]:
    found = [columns.tenant_id == tenant]
    if status:
        found.append(columns.status == status)
    if after:
        found.append(tuple_(columns.created_at, columns.id) < tuple_(*after))
    return found


def _text(column: Any, text: str) -> ColumnElement[bool]:
    pattern = "%" + text.lower().replace("\\", "\\\\").replace("%", r"\%").replace("_", r"\_")
    return func.lower(column).like(pattern + "%", escape="\\")


def _job_rows(
    tenant: str, kind: str | None, status: str | None, q: str | None, after: Any
) -> Select[Any]:
    where = _filters(Job, tenant, status, after)
    if kind:
        where.append(Job.kind == kind)
    if q:
        where.append(or_(Job.id.startswith(q.lower(), autoescape=True), _text(Job.output_name, q)))
    return sql_select(
        Job.id, Job.kind, Job.status, Job.stage, Job.output_name.label("name"),
        *(getattr(Job, c) for c in _JOB_COLUMNS), Job.error, Job.sweep_id, Job.created_at,
    ).where(and_(*where))  # fmt: skip


def _sweep_rows(tenant: str, status: str | None, q: str | None, after: Any) -> Select[Any]:
    where = _filters(Sweep, tenant, status, after)
    if q:
        where.append(Sweep.id.startswith(q.lower(), autoescape=True))
    zero = literal(0)
    return sql_select(
        Sweep.id, literal(SWEEP, String).label("kind"), Sweep.status,
        cast(null(), String).label("stage"), literal("", String).label("name"),
        zero, zero, zero, zero, cast(null(), Sweep.created_at.type).label("started_at"),
        cast(null(), JSON).label("error"), cast(null(), String).label("sweep_id"),
        Sweep.created_at,
    ).where(and_(*where))  # fmt: skip


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
        "created_at": as_utc(row["created_at"]),
        "url": f"/v1/{COLLECTION[kind]}/{row['id']}",
    }
