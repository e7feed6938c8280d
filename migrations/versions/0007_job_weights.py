"""job_weights: the precision a job runs at, (weights, dtype)

jobs.weights: full | int8 | int4 (the weight storage, spec_batch/loading/weights.py); jobs.dtype: the compute dtype
(float32 | bfloat16 | float16). NULL on older jobs and where a queued job leaves the dtype to the worker's device.

Plain ADD/DROP COLUMN (SQLite >= 3.35 has both), not a batch table copy: the job_summary view reads jobs, and a
copy-and-rename would break it on SQLite; the view itself does not change.

Revision ID: 0007_job_weights
Revises: 0006_speedup_range
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_job_weights"
down_revision: str | Sequence[str] | None = "0006_speedup_range"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = ("weights", "dtype")


def upgrade() -> None:
    for name in COLUMNS:
        op.add_column("jobs", sa.Column(name, sa.String(16), nullable=True))


def downgrade() -> None:
    for name in reversed(COLUMNS):
        if op.get_bind().dialect.name == "sqlite":
            op.execute(f"ALTER TABLE jobs DROP COLUMN {name}")
        else:
            op.drop_column("jobs", name)
