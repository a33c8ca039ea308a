"""Indexes for every filter and order the list routes offer: a page of a tenant's jobs of one
kind (by status or not), of its sweeps and of its webhook deliveries is read from an index in
order, not by sorting every row; a job's events are read in id order from one.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-23
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

INDEXES = {
    "ix_jobs_tenant_kind_created": ("jobs", ["tenant_id", "kind", "created_at", "id"]),
    "ix_jobs_tenant_kind_status_created": (
        "jobs",
        ["tenant_id", "kind", "status", "created_at", "id"],
    ),
    "ix_sweeps_tenant_created": ("sweeps", ["tenant_id", "created_at", "id"]),
    "ix_webhook_deliveries_tenant_created": (
        "webhook_deliveries",
        ["tenant_id", "created_at", "id"],
    ),
    "ix_webhook_deliveries_endpoint_created": (
        "webhook_deliveries",
        ["endpoint_id", "created_at", "id"],
    ),
    "ix_job_events_job_id_id": ("job_events", ["job_id", "id"]),
}


def upgrade() -> None:
    for name, (table, columns) in INDEXES.items():
        op.create_index(name, table, columns)


def downgrade() -> None:
    for name, (table, _) in INDEXES.items():
        op.drop_index(name, table_name=table)
