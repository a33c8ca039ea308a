"""Webhook signing secrets encrypted at rest, and endpoint secret rotation with an overlap:
the secret columns widen to hold Fernet tokens, an endpoint keeps its previous secret (and
until when it also signs), and a tenant's endpoints are listed page by page from an index.

Existing plaintext secrets are encrypted by the service at its next start (the key is the
service's, not the migration's: core/webhooks/encryption.py); until then they still sign.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("tenants") as batch:
        batch.alter_column(
            "webhook_secret", type_=sa.Text(), existing_type=sa.String(100), existing_nullable=True
        )
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.alter_column(
            "secret", type_=sa.Text(), existing_type=sa.String(100), existing_nullable=False
        )
        batch.add_column(sa.Column("previous_secret", sa.Text(), nullable=True))
        batch.add_column(
            sa.Column("previous_secret_until", sa.DateTime(timezone=True), nullable=True)
        )
    op.create_index(
        "ix_webhook_endpoints_tenant_created",
        "webhook_endpoints",
        ["tenant_id", "created_at", "id"],
    )


def downgrade() -> None:
    """The rotation columns and the index go; the secrets stay encrypted, in wider columns
    (a release before 0008 cannot read them: rotate every endpoint's secret after going
    back)."""
    op.drop_index("ix_webhook_endpoints_tenant_created", table_name="webhook_endpoints")
    with op.batch_alter_table("webhook_endpoints") as batch:
        batch.drop_column("previous_secret_until")
        batch.drop_column("previous_secret")
