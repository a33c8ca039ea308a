"""Per-tenant storage quota (`LAYERSWAP_TENANT_QUOTA_BYTES`; 0: unlimited): what a tenant stores
counts against it, on disk and in the database.

- Artifacts: the bytes of its live artifacts (merge outputs and analyses the service stored,
  not yet deleted).
- Records: the JSON the database keeps for it: its jobs' requests, results, errors and plan
  summaries (merges, analyses, evaluations), its sweeps' specs and results, and its webhook
  events and delivery logs. Summed in SQL (`length` of the stored text), the same figure on
  SQLite and PostgreSQL. That sum reads every row of the tenant, so each process reuses it for
  `LAYERSWAP_QUOTA_RECORDS_REFRESH_S`; artifacts are summed afresh at every check.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from weakref import WeakKeyDictionary

from sqlalchemy import ColumnElement, Engine, LargeBinary, Text, cast, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from core.db.models import Artifact, Job, Sweep, WebhookDelivery, WebhookEvent
from core.db.session import Database
from core.errors import ServiceError
from core.settings import Settings

# The JSON columns holding what a tenant's requests store, per table with a tenant_id.
RECORDS: tuple[tuple[Any, tuple[InstrumentedAttribute[Any], ...]], ...] = (
    (Job, (Job.request, Job.result, Job.error, Job.plan_summary, Job.sources)),
    (Sweep, (Sweep.request, Sweep.result)),
    (WebhookEvent, (WebhookEvent.payload,)),
    (WebhookDelivery, (WebhookDelivery.attempt_log, WebhookDelivery.last_error)),
)

_counted: WeakKeyDictionary[Engine, dict[str, tuple[float, int]]] = WeakKeyDictionary()
_counted_lock = threading.Lock()


class QuotaExceeded(ServiceError):
    """409: the request is fine, the tenant's storage is full; DELETE /v1/artifacts/{id}
    frees it."""

    code = "quota_exceeded"
    status = 409


@dataclass(frozen=True)
class Usage:
    """What a tenant stores, in bytes."""

    artifact_bytes: int
    record_bytes: int

    @property
    def total(self) -> int:
        return self.artifact_bytes + self.record_bytes

    def details(self) -> dict[str, int]:
        return {
            "usage_bytes": self.total,
            "artifact_bytes": self.artifact_bytes,
            "record_bytes": self.record_bytes,
        }


def usage(session: Session, tenant: str) -> int:
    """Bytes of the tenant's live stored artifacts, summed in SQL."""
    total = session.scalar(
        select(func.coalesce(func.sum(Artifact.size_bytes), 0)).where(
            Artifact.tenant_id == tenant, Artifact.deleted_at.is_(None)
        )
    )
    return int(total or 0)


def record_bytes(session: Session, tenant: str) -> int:
    """Bytes of the JSON the database stores for the tenant (RECORDS), summed in SQL: one
    statement of a sum per table."""
    dialect = session.get_bind().dialect.name
    sums = [
        select(func.coalesce(func.sum(sum(_stored(c, dialect) for c in columns)), 0))
        .where(table.tenant_id == tenant)
        .scalar_subquery()
        for table, columns in RECORDS
    ]
    return int(session.scalar(select(sum(sums[1:], sums[0]))) or 0)


def _stored(column: InstrumentedAttribute[Any], dialect: str) -> ColumnElement[int]:
    """Bytes of a JSON column's stored text (0 for NULL): SQLite's length() counts characters
    unless given bytes, PostgreSQL's octet_length() counts bytes."""
    if dialect == "sqlite":
        return func.coalesce(func.length(cast(column, LargeBinary)), 0)
    return func.coalesce(func.octet_length(cast(column, Text)), 0)


def tenant_usage(session: Session, settings: Settings, tenant: str) -> Usage:
    """The tenant's artifacts, summed now, and its records, as summed at most
    `quota_records_refresh_s` ago by this process."""
    return Usage(usage(session, tenant), _recent_record_bytes(session, settings, tenant))


def _recent_record_bytes(session: Session, settings: Settings, tenant: str) -> int:
    engine, now = session.get_bind(), time.monotonic()
    assert isinstance(engine, Engine)
    with _counted_lock:
        counted = _counted.get(engine, {}).get(tenant)
    if counted is not None and now - counted[0] < settings.quota_records_refresh_s:
        return counted[1]
    found = record_bytes(session, tenant)
    with _counted_lock:
        _counted.setdefault(engine, {})[tenant] = (now, found)
    return found


def check_room(session: Session, settings: Settings, tenant: str, planned: int = 0) -> None:
    """At submit: a tenant at or over its quota may not start another job, nor one whose
    output, as planned from the inputs' headers (`planned` bytes; 0: not known yet), would
    take it past its quota."""
    quota = settings.tenant_quota_bytes
    if not quota:
        return
    used = tenant_usage(session, settings, tenant)
    if used.total >= quota or used.total + planned > quota:
        raise _exceeded(used, planned, quota)


def space_reserver(db: Database, settings: Settings, tenant: str) -> Callable[[int], None] | None:
    """The engine's `reserve_space` hook for one job: called with the planned output size once
    the plan is made, before anything is written; raises QuotaExceeded if the output would take
    the tenant past its quota. None without a quota. Jobs running at the same time are each
    checked against what is stored, so together they may overshoot by their own sizes."""
    quota = settings.tenant_quota_bytes
    if not quota:
        return None

    def reserve(planned: int) -> None:
        with db.session() as session:
            used = tenant_usage(session, settings, tenant)
        if used.total + planned > quota:
            raise _exceeded(used, planned, quota)

    return reserve


def _exceeded(used: Usage, planned: int, quota: int) -> QuotaExceeded:
    """The refusal, with the figures and what frees room."""
    more = f" + {planned} planned for this job" if planned else ""
    return QuotaExceeded(
        f"storage quota exceeded: {used.total} bytes used ({used.artifact_bytes} by artifacts, "
        f"{used.record_bytes} by job records){more}, of {quota}; delete artifacts you no "
        "longer need (DELETE /v1/artifacts/{id}) to free space",
        details={
            **used.details(),
            **({"planned_bytes": planned} if planned else {}),
            "quota_bytes": quota,
        },
    )
