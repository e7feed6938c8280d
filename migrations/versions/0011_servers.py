"""servers: the running servers' local batch runners (target, drafter, weights, dtype, last seen), so that a batch
object can say when no running server can run it (issue 38)

A new table; nothing else changes.

Revision ID: 0011_servers
Revises: 0010_batch_expiry
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011_servers"
down_revision: str | Sequence[str] | None = "0010_batch_expiry"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "servers",
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("target", sa.String(512), nullable=False),
        sa.Column("drafter", sa.String(512), nullable=False),
        sa.Column("weights", sa.String(16), nullable=True),
        sa.Column("dtype", sa.String(16), nullable=True),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_servers")),
    )
    op.create_index(op.f("ix_servers_seen_at"), "servers", ["seen_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_servers_seen_at"), table_name="servers")
    op.drop_table("servers")
