"""jobs: the range of the measured speedup (speedup_low, speedup_high); job_summary gains them and speedup_reliable

The baseline sample is measured in interleaved rounds (with and without speculation, alternating, on the same
requests); each round gives a ratio, and the lowest and highest are kept beside the pooled speedup. The number
is unreliable when (high - low) > 25% of the speedup (the load changed while it was measured).

job_summary keeps every column of 0003 in place and appends speedup_low, speedup_high and speedup_reliable
(NULL when no range was measured: jobs measured before this migration, or no baseline).

Revision ID: 0006_speedup_range
Revises: 0005_request_outputs
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_speedup_range"
down_revision: str | Sequence[str] | None = "0005_request_outputs"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

UNRELIABLE_SPREAD = 0.25  # spec_batch.jobs.speedup.UNRELIABLE_SPREAD (migrations never import the app)

SPEEDUP = """(CAST(j.sample_output_tokens AS DOUBLE PRECISION) / NULLIF(j.sample_wall_s, 0))
        / NULLIF(CAST(j.baseline_output_tokens AS DOUBLE PRECISION) / NULLIF(j.baseline_wall_s, 0), 0)"""


def _view_sql(with_range: bool) -> str:
    """0003's view, with the speedup's range appended (a copy: migrations never import each other)."""
    range_cols = (
        f""",
    j.speedup_low AS speedup_low,
    j.speedup_high AS speedup_high,
    CASE
        WHEN j.speedup_low IS NULL OR j.speedup_high IS NULL OR ({SPEEDUP}) IS NULL THEN NULL
        WHEN (j.speedup_high - j.speedup_low) > {UNRELIABLE_SPREAD} * ({SPEEDUP}) THEN FALSE
        ELSE TRUE
    END AS speedup_reliable"""
        if with_range
        else ""
    )
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
    {SPEEDUP}
        AS speedup,
    j.created_at AS created_at,
    j.completed_at AS completed_at,
    COALESCE(r.forced_tokens, 0) AS forced_tokens{range_cols}
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
        SUM(COALESCE(target_forwards, 0)) AS target_forwards,
        SUM(COALESCE(forced_tokens, 0)) AS forced_tokens
    FROM requests
    GROUP BY job_id
) AS r ON r.job_id = j.id
"""


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_summary")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.add_column(sa.Column("speedup_low", sa.Float(), nullable=True))
        batch_op.add_column(sa.Column("speedup_high", sa.Float(), nullable=True))
    op.execute(_view_sql(with_range=True))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_summary")
    with op.batch_alter_table("jobs") as batch_op:
        batch_op.drop_column("speedup_high")
        batch_op.drop_column("speedup_low")
    op.execute(_view_sql(with_range=False))
