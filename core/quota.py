"""Per-tenant storage quota: the bytes of a tenant's live artifacts (merge outputs and analyses
the service stored, not yet deleted) against `LAYERSWAP_TENANT_QUOTA_BYTES` (0: unlimited)."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from core.db.models import Artifact
from core.db.session import Database
from core.errors import ServiceError
from core.settings import Settings


class QuotaExceeded(ServiceError):
    """409: the request is fine, the tenant's storage is full; DELETE /v1/artifacts/{id}
    frees it."""

    code = "quota_exceeded"
    status = 409


def usage(session: Session, tenant: str) -> int:
    """Bytes of the tenant's live stored artifacts, summed in SQL."""
    total = session.scalar(
        select(func.coalesce(func.sum(Artifact.size_bytes), 0)).where(
            Artifact.tenant_id == tenant, Artifact.deleted_at.is_(None)
        )
    )
    return int(total or 0)


def check_room(session: Session, settings: Settings, tenant: str) -> None:
    """At submit: a tenant already at or over its quota may not start another job."""
    quota = settings.tenant_quota_bytes
    if not quota:
        return
    used = usage(session, tenant)
    if used >= quota:
        raise QuotaExceeded(
            f"storage quota reached: {used} of {quota} bytes used; delete artifacts to free space",
            details={"usage_bytes": used, "quota_bytes": quota},
        )


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
            used = usage(session, tenant)
        if used + planned > quota:
            raise QuotaExceeded(
                f"storage quota exceeded: {used} bytes used + {planned} planned > {quota}",
                details={"usage_bytes": used, "planned_bytes": planned, "quota_bytes": quota},
            )

    return reserve
