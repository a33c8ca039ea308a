"""Evaluation scores: one row per task × filter × metric of an evaluation job.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "evaluation_scores",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(32), sa.ForeignKey("jobs.id"), nullable=False),
        sa.Column("tenant_id", sa.String(64), sa.ForeignKey("tenants.id"), nullable=False),
        sa.Column("artifact_id", sa.String(32), sa.ForeignKey("artifacts.id"), nullable=False),
        sa.Column("reuse_key", sa.String(64), nullable=False),
        sa.Column("task", sa.String(100), nullable=False),
        sa.Column("filter", sa.String(100), nullable=False),
        sa.Column("metric", sa.String(100), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.Column("stderr", sa.Float(), nullable=True),
        sa.Column("num_fewshot", sa.Integer(), nullable=True),
        sa.Column("samples", sa.Integer(), nullable=False),
        sa.Column("task_version", sa.String(32), nullable=False),
        sa.Column("config_hash", sa.String(64), nullable=False),
        sa.Column("lm_eval_version", sa.String(32), nullable=False),
        sa.Column("backend", sa.String(16), nullable=False),
        sa.Column("settings", sa.JSON(), nullable=False),
        sa.Column("duration_s", sa.Float(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    for column in ("job_id", "tenant_id", "artifact_id", "reuse_key"):
        op.create_index(f"ix_evaluation_scores_{column}", "evaluation_scores", [column])


def downgrade() -> None:
    op.drop_table("evaluation_scores")
