"""requests: forced tokens and per-draft-position counts; job_summary gains forced_tokens

- forced_tokens: output tokens a grammar allowed alone (structured output), drafted with certainty.
- drafted_per_position[j] / accepted_per_position[j]: steps in which draft position j was proposed / accepted
  (acceptance rate by draft position, for reports).

job_summary keeps every column of 0001 in place and appends forced_tokens.

Revision ID: 0003_positions
Revises: 0002_queue
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0003_positions"
down_revision: str | Sequence[str] | None = "0002_queue"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")


def _view_sql(with_forced: bool) -> str:
    """0001's view, with forced_tokens appended (a copy: migrations never import each other)."""
    forced_col = ",\n    COALESCE(r.forced_tokens, 0) AS forced_tokens" if with_forced else ""
    forced_sum = ",\n        SUM(COALESCE(forced_tokens, 0)) AS forced_tokens" if with_forced else ""
    return f"""
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
    j.completed_at AS completed_at{forced_col}
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
        SUM(COALESCE(target_forwards, 0)) AS target_forwards{forced_sum}
    FROM requests
    GROUP BY job_id
) AS r ON r.job_id = j.id
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_summary")
    with op.batch_alter_table("requests") as batch_op:
        batch_op.add_column(sa.Column("forced_tokens", sa.Integer(), nullable=True))
        batch_op.add_column(sa.Column("drafted_per_position", JSON, nullable=True))
        batch_op.add_column(sa.Column("accepted_per_position", JSON, nullable=True))
    op.execute(_view_sql(with_forced=True))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_summary")
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_column("accepted_per_position")
        batch_op.drop_column("drafted_per_position")
        batch_op.drop_column("forced_tokens")
    op.execute(_view_sql(with_forced=False))
