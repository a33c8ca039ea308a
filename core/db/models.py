"""The system of record: SQLAlchemy 2 models. Alembic migrations create the schema."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any, ClassVar, overload

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship


def utcnow() -> datetime:
    return datetime.now(UTC)


@overload
def as_utc(value: datetime) -> datetime: ...
@overload
def as_utc(value: None) -> None: ...
def as_utc(value: datetime | None) -> datetime | None:
    """SQLite hands back naive datetimes; every stored time is UTC."""
    return value.replace(tzinfo=UTC) if value is not None and value.tzinfo is None else value


class Base(DeclarativeBase):
    type_annotation_map: ClassVar[dict[Any, Any]] = {dict[str, Any]: JSON, list[Any]: JSON}


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Signs one-off webhooks (a merge's own `webhook` URL); made on first use. Encrypted
    # (core/webhooks/encryption.py).
    webhook_secret: Mapped[str | None] = mapped_column(Text)


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 of the secret
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        # the list routes' filters and order (migration 0007)
        Index("ix_jobs_tenant_kind_created", "tenant_id", "kind", "created_at", "id"),
        Index(
            "ix_jobs_tenant_kind_status_created", "tenant_id", "kind", "status", "created_at", "id"
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # merge | analysis
    status: Mapped[str] = mapped_column(String(16), index=True)
    stage: Mapped[str | None] = mapped_column(String(32))
    request: Mapped[dict[str, Any]] = mapped_column(JSON)
    request_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    output_name: Mapped[str] = mapped_column(String(200))
    plan_digest: Mapped[str | None] = mapped_column(String(64))
    plan_summary: Mapped[list[Any] | None] = mapped_column(JSON)
    bytes_done: Mapped[int] = mapped_column(BigInteger, default=0)
    bytes_total: Mapped[int] = mapped_column(BigInteger, default=0)
    tensors_done: Mapped[int] = mapped_column(Integer, default=0)
    tensors_total: Mapped[int] = mapped_column(Integer, default=0)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    max_attempts: Mapped[int] = mapped_column(Integer, default=3)
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    error: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Hub sources as asked for and the commit each was pinned to at submit time.
    sources: Mapped[list[Any] | None] = mapped_column(JSON)
    output_artifact_id: Mapped[str | None] = mapped_column(ForeignKey("artifacts.id"))
    # Loaded only where asked for (jobs.get, list_jobs: with the job, not by a query per view);
    # touching it unloaded raises instead of querying behind the caller's back.
    output_artifact: Mapped[Artifact | None] = relationship(lazy="raise", viewonly=True)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    # The sweep that created this job (its trial is request["sweep"]); None for others.
    sweep_id: Mapped[str | None] = mapped_column(String(32), index=True)


class Sweep(Base):
    """Expert pairs × configurations, expanded into merge and evaluation jobs (jobs.sweep_id);
    its status follows theirs (service/sweeps/advance.py)."""

    __tablename__ = "sweeps"
    __table_args__ = (
        UniqueConstraint("tenant_id", "idempotency_key"),
        Index("ix_sweeps_tenant_created", "tenant_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    status: Mapped[str] = mapped_column(String(16), index=True)  # running | canceling | ...
    request: Mapped[dict[str, Any]] = mapped_column(JSON)  # the spec, Hub sources pinned
    request_hash: Mapped[str] = mapped_column(String(64))
    idempotency_key: Mapped[str | None] = mapped_column(String(200))
    num_layers: Mapped[int] = mapped_column(Integer)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(
        DateTime(timezone=True), default=utcnow, index=True
    )
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class JobEvent(Base):
    __tablename__ = "job_events"
    __table_args__ = (Index("ix_job_events_job_id_id", "job_id", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Artifact(Base):
    __tablename__ = "artifacts"

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    kind: Mapped[str] = mapped_column(String(16))  # checkpoint | analysis
    location: Mapped[str] = mapped_column(Text)  # resolved local path
    content_digest: Mapped[str] = mapped_column(String(64), index=True)  # over file sha256s
    files: Mapped[dict[str, Any]] = mapped_column(JSON)  # name -> sha256
    architecture: Mapped[str | None] = mapped_column(String(64))
    num_layers: Mapped[int | None] = mapped_column(Integer)
    published: Mapped[list[Any] | None] = mapped_column(JSON)  # Hub commits holding it
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # Bytes the service stored for it (its outputs and analyses; None for inputs it only
    # read): what counts against the tenant's quota until it is deleted.
    size_bytes: Mapped[int | None] = mapped_column(BigInteger)
    # Deleted through the API: its files are gone, its row stays for lineage.
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class LineageEdge(Base):
    """One input or output of a job: artifact -> job -> artifact."""

    __tablename__ = "lineage_edges"
    __table_args__ = (UniqueConstraint("job_id", "artifact_id", "direction", "role"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id"), index=True)
    direction: Mapped[str] = mapped_column(String(8))  # input | output
    role: Mapped[str] = mapped_column(String(32))  # task, language, base, model, output
    label: Mapped[str] = mapped_column(String(64))
    weight: Mapped[float | None] = mapped_column(Float)


class EvaluationScore(Base):
    """One number of an evaluation: task × filter × metric, with what it depends on. `reuse_key`
    covers everything that can change it before the run (model content, task, settings, lm-eval
    version, backend, task files), so an equal key answers a later request without running."""

    __tablename__ = "evaluation_scores"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    artifact_id: Mapped[str] = mapped_column(ForeignKey("artifacts.id"), index=True)
    reuse_key: Mapped[str] = mapped_column(String(64), index=True)
    task: Mapped[str] = mapped_column(String(100))
    filter: Mapped[str] = mapped_column(String(100))
    metric: Mapped[str] = mapped_column(String(100))
    value: Mapped[float] = mapped_column(Float)
    stderr: Mapped[float | None] = mapped_column(Float)
    num_fewshot: Mapped[int | None] = mapped_column(Integer)
    samples: Mapped[int] = mapped_column(Integer)
    task_version: Mapped[str] = mapped_column(String(32))
    config_hash: Mapped[str] = mapped_column(String(64))
    lm_eval_version: Mapped[str] = mapped_column(String(32))
    backend: Mapped[str] = mapped_column(String(16))
    settings: Mapped[dict[str, Any]] = mapped_column(JSON)
    duration_s: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookEndpoint(Base):
    """A tenant's subscription: events of these types are POSTed, signed, to `url`."""

    __tablename__ = "webhook_endpoints"
    # a tenant's page of endpoints, in order (migration 0008)
    __table_args__ = (
        Index("ix_webhook_endpoints_tenant_created", "tenant_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[Any]] = mapped_column(JSON)
    description: Mapped[str] = mapped_column(String(500), default="")
    # whsec_..., encrypted (core/webhooks/encryption.py); needed to sign, shown once.
    secret: Mapped[str] = mapped_column(Text)
    # The secret before the last rotation, encrypted; it also signs until previous_secret_until.
    previous_secret: Mapped[str | None] = mapped_column(Text)
    previous_secret_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    disabled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    disabled_reason: Mapped[str | None] = mapped_column(Text)
    deleted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class WebhookEvent(Base):
    """The outbox: written in the transaction of the state change it reports."""

    __tablename__ = "webhook_events"

    id: Mapped[str] = mapped_column(String(40), primary_key=True)  # msg_...: the webhook-id
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    type: Mapped[str] = mapped_column(String(64))
    subject_id: Mapped[str] = mapped_column(String(32), index=True)  # the job or sweep
    payload: Mapped[dict[str, Any]] = mapped_column(JSON)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class WebhookDelivery(Base):
    """One event to one endpoint (or to a job's one-off URL), with every attempt."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (
        Index("ix_webhook_deliveries_tenant_created", "tenant_id", "created_at", "id"),
        Index("ix_webhook_deliveries_endpoint_created", "endpoint_id", "created_at", "id"),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    event_id: Mapped[str] = mapped_column(ForeignKey("webhook_events.id"), index=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id"), index=True)
    endpoint_id: Mapped[str | None] = mapped_column(String(32), index=True)  # None: one-off
    url: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    attempt_log: Mapped[list[Any]] = mapped_column(JSON, default=list)
    next_attempt_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), index=True)
    locked_until: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
