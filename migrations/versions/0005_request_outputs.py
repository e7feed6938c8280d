"""requests: custom_id kept for invalid lines; request options and output choices beyond `output`

- custom_id: unique among a job's valid rows only (a partial unique index, WHERE endpoint IS NOT NULL), so an
  invalid line keeps the custom_id it had (it was stored NULL because of the unique constraint).
- options (JSON): what a line asked for beyond SamplingParams: n, tools, logprobs, and the fields accepted and
  recorded that change nothing here (user, store, metadata, service_tier, stream_options, parallel_tool_calls).
- choices (JSON): the output choices when `output` is not enough: n > 1, logprobs, tool calls.

job_summary is unchanged; SQLite rebuilds the requests table to drop the constraint, so the view (whatever its
current definition) is read, dropped and created again around that.

Revision ID: 0005_request_outputs
Revises: 0004_baseline_samples
Create Date: 2026-12-02
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0005_request_outputs"
down_revision: str | Sequence[str] | None = "0004_baseline_samples"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
INDEX = "uq_requests_job_id_custom_id_valid"
VALID = sa.text("endpoint IS NOT NULL")


def _sqlite_view() -> str | None:
    """SQLite: the view's current SQL, dropped (a table rebuild under a view fails); None elsewhere."""
    bind = op.get_bind()
    if bind.dialect.name != "sqlite":
        return None
    sql = bind.execute(sa.text("SELECT sql FROM sqlite_master WHERE type = 'view' AND name = 'job_summary'")).scalar()
    if sql is not None:
        op.execute("DROP VIEW job_summary")
    return sql


def upgrade() -> None:
    view = _sqlite_view()
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_constraint("uq_requests_job_id_custom_id", type_="unique")
        batch_op.add_column(sa.Column("options", JSON, nullable=True))
        batch_op.add_column(sa.Column("choices", JSON, nullable=True))
        batch_op.create_index(INDEX, ["job_id", "custom_id"], unique=True, sqlite_where=VALID, postgresql_where=VALID)
    if view is not None:
        op.execute(view)
    _backfill_invalid_custom_ids()


def _backfill_invalid_custom_ids() -> None:
    """Invalid lines stored before this revision get the custom_id their stored line has (a non-empty string of
    at most 512 characters), so export no longer re-parses the line."""
    bind = op.get_bind()
    rows = bind.execute(sa.text("SELECT id, input FROM requests WHERE endpoint IS NULL AND custom_id IS NULL"))
    found = []
    for rid, line in rows:
        try:
            obj = json.loads(line)
        except (TypeError, ValueError):
            continue
        cid = obj.get("custom_id") if isinstance(obj, dict) else None
        if isinstance(cid, str) and 0 < len(cid) <= 512:
            found.append({"i": rid, "c": cid})
    if found:
        bind.execute(sa.text("UPDATE requests SET custom_id = :c WHERE id = :i"), found)


def downgrade() -> None:
    view = _sqlite_view()
    op.execute("UPDATE requests SET custom_id = NULL WHERE endpoint IS NULL")  # the old rule: NULL when invalid
    with op.batch_alter_table("requests") as batch_op:
        batch_op.drop_index(INDEX)
        batch_op.drop_column("choices")
        batch_op.drop_column("options")
        batch_op.create_unique_constraint("uq_requests_job_id_custom_id", ["job_id", "custom_id"])
    if view is not None:
        op.execute(view)
