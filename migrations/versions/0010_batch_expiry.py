"""batch_expiry: the job status `expired` (a batch not finished within its completion_window), jobs.expired_at, and
batches.output_deleted_at / errors_deleted_at (a batch's result file deleted through the Files API)

The status check of jobs gains 'expired'. On PostgreSQL the constraint is dropped and made again. On SQLite a
CHECK constraint cannot be altered, and a copy-and-rename of jobs would break the job_summary view and (with
foreign keys on) cascade the drop of jobs to its requests; so the constraint's text is rewritten in the schema
table, as SQLite documents for a change that only loosens a constraint ("Making Other Kinds Of Table Schema
Changes", sqlite.org/lang_altertable.html): no stored row changes. Columns are plain ADD/DROP COLUMN (as 0007).

Downgrade: expired jobs become cancelled (their cancelled_at the time they expired), then the old constraint.

Revision ID: 0010_batch_expiry
Revises: 0009_drafters
Create Date: 2026-12-05
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_batch_expiry"
down_revision: str | Sequence[str] | None = "0009_drafters"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OLD = ("validating", "in_progress", "finalizing", "completed", "failed", "cancelling", "cancelled")
NEW = (*OLD, "expired")
BATCH_COLUMNS = ("output_deleted_at", "errors_deleted_at")


def _in(values: tuple[str, ...]) -> str:
    return f"status IN ({', '.join(repr(v) for v in values)})"


def _status_check(old: tuple[str, ...], new: tuple[str, ...]) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(op.f("ck_jobs_status"), "jobs", type_="check")
        op.create_check_constraint(op.f("ck_jobs_status"), "jobs", _in(new))
        return
    bind = op.get_bind()
    sql = bind.exec_driver_sql("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'jobs'").scalar_one()
    if _in(old) not in sql:
        raise RuntimeError(f"jobs' status check is not the one expected ({_in(old)}): {sql}")
    version = bind.exec_driver_sql("PRAGMA schema_version").scalar_one()
    bind.exec_driver_sql("PRAGMA writable_schema = ON")
    bind.exec_driver_sql(
        "UPDATE sqlite_master SET sql = ? WHERE type = 'table' AND name = 'jobs'", (sql.replace(_in(old), _in(new)),)
    )
    bind.exec_driver_sql(f"PRAGMA schema_version = {int(version) + 1}")
    bind.exec_driver_sql("PRAGMA writable_schema = OFF")


def _drop_column(table: str, name: str) -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute(f"ALTER TABLE {table} DROP COLUMN {name}")
    else:
        op.drop_column(table, name)


def upgrade() -> None:
    op.add_column("jobs", sa.Column("expired_at", sa.DateTime(timezone=True), nullable=True))
    for name in BATCH_COLUMNS:
        op.add_column("batches", sa.Column(name, sa.DateTime(timezone=True), nullable=True))
    _status_check(OLD, NEW)


def downgrade() -> None:
    op.execute(
        "UPDATE jobs SET status = 'cancelled', cancelled_at = COALESCE(cancelled_at, expired_at) "
        "WHERE status = 'expired'"
    )
    _status_check(NEW, OLD)
    for name in reversed(BATCH_COLUMNS):
        _drop_column("batches", name)
    _drop_column("jobs", "expired_at")
