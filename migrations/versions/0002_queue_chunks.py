"""queue_chunks: the chunks of a job published to Celery (see spec_batch/store/queue.py)

Revision ID: 0002_queue
Revises: 0001
Create Date: 2025-01-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0002_queue"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)
CHUNK_STATES = ("queued", "running", "done", "split")


def upgrade() -> None:
    op.create_table(
        "queue_chunks",
        sa.Column("id", sa.String(36), nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("queue", sa.String(128), nullable=False),
        sa.Column("request_ids", JSON, nullable=False),
        sa.Column("measure_baseline", sa.Boolean(), server_default=sa.false(), nullable=False),
        sa.Column("state", sa.String(16), server_default="queued", nullable=False),
        sa.Column("epoch", sa.String(64), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("published_at", TS, nullable=True),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finished_at", TS, nullable=True),
        sa.CheckConstraint(
            "state IN (" + ", ".join(repr(s) for s in CHUNK_STATES) + ")", name=op.f("ck_queue_chunks_state")
        ),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_queue_chunks_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_queue_chunks")),
    )
    with op.batch_alter_table("queue_chunks") as batch_op:
        batch_op.create_index(batch_op.f("ix_queue_chunks_job_id"), ["job_id"], unique=False)
        batch_op.create_index("ix_queue_chunks_state_lease_expires_at", ["state", "lease_expires_at"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("queue_chunks") as batch_op:
        batch_op.drop_index("ix_queue_chunks_state_lease_expires_at")
        batch_op.drop_index(batch_op.f("ix_queue_chunks_job_id"))
    op.drop_table("queue_chunks")
