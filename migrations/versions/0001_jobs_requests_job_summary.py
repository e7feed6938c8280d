"""jobs, requests and the job_summary view

A later migration that alters ``jobs`` or ``requests`` must ``DROP VIEW job_summary`` first and create it again
afterwards (with its own copy of the view's SQL): SQLite's batch (table copy + rename) ALTER fails with "error in
view job_summary: no such table", and PostgreSQL refuses to change a column a view uses.

Revision ID: 0001
Revises:
Create Date: 2025-01-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001"
down_revision: str | Sequence[str] | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
TS = sa.DateTime(timezone=True)

JOB_STATUSES = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled")
REQUEST_STATUSES = ("pending", "running", "completed", "failed", "cancelled")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


# One row per job. Counts and token sums are over the job's request rows (invalid lines are failed rows).
# tokens_per_s: output tokens over the job's decode time (jobs.decode_wall_s: seconds inside generate(),
# summed over runs and workers), not over the sum of per-request wall times (requests of a batch overlap).
# speedup: tokens/s of the baseline sample decoded with speculation over tokens/s of the same sample without
# it (same engine, same batch size); NULL when the job measured no baseline.
JOB_SUMMARY_SQL = """
CREATE VIEW job_summary AS
SELECT
    j.id AS job_id,
    j.status AS status,
    j.target AS target,
    j.drafter AS drafter,
    COALESCE(r.n_requests, 0) AS n_requests,
    COALESCE(r.n_completed, 0) AS n_completed,
    COALESCE(r.n_failed, 0) AS n_failed,
    COALESCE(r.output_tokens, 0) AS output_tokens,
    CAST(r.accepted_tokens AS DOUBLE PRECISION) / NULLIF(r.draft_tokens, 0) AS acceptance_rate,
    CAST(r.output_tokens AS DOUBLE PRECISION) / NULLIF(r.target_forwards, 0) AS tokens_per_step,
    CAST(r.output_tokens AS DOUBLE PRECISION) / NULLIF(j.decode_wall_s, 0) AS tokens_per_s,
    CAST(j.baseline_output_tokens AS DOUBLE PRECISION) / NULLIF(j.baseline_wall_s, 0) AS baseline_tokens_per_s,
    (CAST(j.sample_output_tokens AS DOUBLE PRECISION) / NULLIF(j.sample_wall_s, 0))
        / NULLIF(CAST(j.baseline_output_tokens AS DOUBLE PRECISION) / NULLIF(j.baseline_wall_s, 0), 0)
        AS speedup,
    j.created_at AS created_at,
    j.completed_at AS completed_at
FROM jobs AS j
LEFT JOIN (
    SELECT
        job_id,
        COUNT(*) AS n_requests,
        SUM(CASE WHEN status = 'completed' THEN 1 ELSE 0 END) AS n_completed,
        SUM(CASE WHEN status = 'failed' THEN 1 ELSE 0 END) AS n_failed,
        SUM(COALESCE(output_tokens, 0)) AS output_tokens,
        SUM(COALESCE(draft_tokens, 0)) AS draft_tokens,
        SUM(COALESCE(accepted_tokens, 0)) AS accepted_tokens,
        SUM(COALESCE(target_forwards, 0)) AS target_forwards
    FROM requests
    GROUP BY job_id
) AS r ON r.job_id = j.id
"""


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("status", sa.String(16), server_default="validating", nullable=False),
        sa.Column("target", sa.String(512), nullable=False),
        sa.Column("drafter", sa.String(512), nullable=False),
        sa.Column("input_file", sa.String(1024), nullable=True),
        sa.Column("output_file", sa.String(1024), nullable=True),
        sa.Column("sampling_defaults", JSON, nullable=False),
        sa.Column("metadata", JSON, nullable=True),
        sa.Column("batch_size", sa.Integer(), server_default="8", nullable=False),
        sa.Column("baseline_sample", sa.Integer(), server_default="8", nullable=False),
        sa.Column("chunk_size", sa.Integer(), nullable=True),
        sa.Column("queue", sa.String(128), nullable=True),
        sa.Column("n_requests", sa.Integer(), server_default="0", nullable=False),
        sa.Column("n_invalid", sa.Integer(), server_default="0", nullable=False),
        sa.Column("decode_wall_s", sa.Float(), server_default="0", nullable=False),
        sa.Column("baseline_requests", sa.Integer(), nullable=True),
        sa.Column("baseline_output_tokens", sa.Integer(), nullable=True),
        sa.Column("baseline_wall_s", sa.Float(), nullable=True),
        sa.Column("sample_output_tokens", sa.Integer(), nullable=True),
        sa.Column("sample_wall_s", sa.Float(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("created_at", TS, nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("finalizing_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("failed_at", TS, nullable=True),
        sa.Column("cancelled_at", TS, nullable=True),
        sa.CheckConstraint(_in("status", JOB_STATUSES), name=op.f("ck_jobs_status")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_jobs")),
    )
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.create_index(batch_op.f("ix_jobs_status"), ["status"], unique=False)

    op.create_table(
        "requests",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("job_id", sa.String(40), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=True),
        sa.Column("line_number", sa.Integer(), nullable=False),
        sa.Column("input", sa.Text(), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=True),
        sa.Column("prompt", JSON, nullable=True),
        sa.Column("params", JSON, nullable=True),
        sa.Column("status", sa.String(16), server_default="pending", nullable=False),
        sa.Column("output", sa.Text(), nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("error_code", sa.String(64), nullable=True),
        sa.Column("error_param", sa.String(255), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("output_tokens", sa.Integer(), nullable=True),
        sa.Column("draft_tokens", sa.Integer(), nullable=True),
        sa.Column("accepted_tokens", sa.Integer(), nullable=True),
        sa.Column("target_forwards", sa.Integer(), nullable=True),
        sa.Column("draft_forwards", sa.Integer(), nullable=True),
        sa.Column("accepted_length_histogram", JSON, nullable=True),
        sa.Column("wall_s", sa.Float(), nullable=True),
        sa.Column("worker", sa.String(255), nullable=True),
        sa.Column("attempts", sa.Integer(), server_default="0", nullable=False),
        sa.Column("started_at", TS, nullable=True),
        sa.Column("completed_at", TS, nullable=True),
        sa.Column("lease_expires_at", TS, nullable=True),
        sa.CheckConstraint(_in("status", REQUEST_STATUSES), name=op.f("ck_requests_status")),
        sa.ForeignKeyConstraint(["job_id"], ["jobs.id"], name=op.f("fk_requests_job_id_jobs"), ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_requests")),
        sa.UniqueConstraint("job_id", "custom_id", name=op.f("uq_requests_job_id_custom_id")),
        sa.UniqueConstraint("job_id", "line_number", name=op.f("uq_requests_job_id_line_number")),
    )
    with op.batch_alter_table("requests") as batch_op:
        batch_op.create_index("ix_requests_job_id_status", ["job_id", "status"], unique=False)

    op.execute(JOB_SUMMARY_SQL)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_summary")
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_index("ix_requests_job_id_status")
    op.drop_table("requests")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_status"))
    op.drop_table("jobs")
