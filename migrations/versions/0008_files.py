"""files: uploaded files (content in chunks of at most ~1 MB) and batches of the OpenAI-compatible API

New tables only (files, file_chunks, batches): jobs, requests and the job_summary view do not change, so no table
is copied on SQLite and the downgrade drops the three tables.

Revision ID: 0008_files
Revises: 0007_job_weights
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_files"
down_revision: str | Sequence[str] | None = "0007_job_weights"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(postgresql.JSONB(), "postgresql")
UTC = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner", sa.String(80), nullable=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger(), nullable=False),
        sa.Column("line_count", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("created_at", UTC, nullable=False),
        sa.CheckConstraint("status IN ('uploaded', 'processed', 'error')", name="ck_files_status"),
        sa.PrimaryKeyConstraint("id", name="pk_files"),
    )
    with op.batch_alter_table("files") as batch:
        batch.create_index("ix_files_owner", ["owner"])
        batch.create_index("ix_files_created_at", ["created_at"])
    op.create_table(
        "file_chunks",
        sa.Column("file_id", sa.String(40), nullable=False),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["file_id"], ["files.id"], name="fk_file_chunks_file_id_files", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("file_id", "seq", name="pk_file_chunks"),
    )
    op.create_table(
        "batches",
        sa.Column("id", sa.String(40), nullable=False),
        sa.Column("owner", sa.String(80), nullable=True),
        sa.Column("input_file_id", sa.String(40), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("errors", JSON, nullable=True),
        sa.Column("cancelling_at", UTC, nullable=True),
        sa.Column("created_at", UTC, nullable=False),
        sa.ForeignKeyConstraint(["id"], ["jobs.id"], name="fk_batches_id_jobs", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_batches"),
    )
    with op.batch_alter_table("batches") as batch:
        batch.create_index("ix_batches_owner", ["owner"])
        batch.create_index("ix_batches_created_at", ["created_at"])


def downgrade() -> None:
    op.drop_table("batches")
    op.drop_table("file_chunks")
    op.drop_table("files")
