"""worker_queues: the queues each running worker process consumes (last seen), so that a queued batch's object can
say when no running worker serves its queue, as a local batch's says when no server runs its kind

A new table; nothing else changes.

Revision ID: 0012_worker_queues
Revises: 0011_servers
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_worker_queues"
down_revision: str | Sequence[str] | None = "0011_servers"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "worker_queues",
        sa.Column("worker", sa.String(64), nullable=False),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("worker", "queue", name=op.f("pk_worker_queues")),
    )
    op.create_index(op.f("ix_worker_queues_seen_at"), "worker_queues", ["seen_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_worker_queues_seen_at"), table_name="worker_queues")
    op.drop_table("worker_queues")
