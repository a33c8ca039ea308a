"""Hub sources and destinations: the commit each source was pinned to, and where an output
was published.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-21
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("jobs") as batch:
        batch.add_column(sa.Column("sources", sa.JSON(), nullable=True))
    with op.batch_alter_table("artifacts") as batch:
        batch.add_column(sa.Column("published", sa.JSON(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("artifacts") as batch:
        batch.drop_column("published")
    with op.batch_alter_table("jobs") as batch:
        batch.drop_column("sources")
