"""baseline_samples: the baseline sample request by request (with and without speculation)

The job row keeps the sample's totals (jobs.baseline_*, jobs.sample_*); this table keeps each sampled request's
pair, for reports. A new table: jobs, requests and job_summary are unchanged.

Revision ID: 0004_baseline_samples
Revises: 0003_positions
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_baseline_samples"
down_revision: str | Sequence[str] | None = "0003_positions"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "baseline_samples",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("request_id", sa.Integer(), nullable=False),
        sa.Column("speculative_output_tokens", sa.Integer(), nullable=False),
        sa.Column("speculative_target_forwards", sa.Integer(), nullable=False),
        sa.Column("speculative_wall_s", sa.Float(), nullable=False),
        sa.Column("baseline_output_tokens", sa.Integer(), nullable=False),
        sa.Column("baseline_wall_s", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(
            ["job_id"], ["jobs.id"], name=op.f("fk_baseline_samples_job_id_jobs"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["request_id"],
            ["requests.id"],
            name=op.f("fk_baseline_samples_request_id_requests"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_baseline_samples")),
        sa.UniqueConstraint("request_id", name=op.f("uq_baseline_samples_request_id")),
    )
    with op.batch_alter_table("baseline_samples") as batch_op:
        batch_op.create_index(batch_op.f("ix_baseline_samples_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("baseline_samples") as batch_op:
        batch_op.drop_index(batch_op.f("ix_baseline_samples_job_id"))
    op.drop_table("baseline_samples")
