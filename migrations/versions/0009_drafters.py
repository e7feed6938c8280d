"""drafters: trained draft heads (name, target, source jobs, tokens trained, held-out accepted length, weights)

A new table; jobs, requests and job_summary are unchanged. The weights (safetensors, a few MB) and config.json live
in the row, so a worker on another machine loads a head by name.

Revision ID: 0009_drafters
Revises: 0008_files
Create Date: 2026-12-03
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0009_drafters"
down_revision: str | Sequence[str] | None = "0008_files"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JSON = sa.JSON().with_variant(JSONB(), "postgresql")


def upgrade() -> None:
    op.create_table(
        "drafters",
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("kind", sa.String(32), server_default="head", nullable=False),
        sa.Column("target", sa.String(512), nullable=False),
        sa.Column("source_jobs", JSON, nullable=False),
        sa.Column("tokens_trained", sa.Integer(), nullable=False),
        sa.Column("heldout_accepted_length", sa.Float(), nullable=True),
        sa.Column("config", JSON, nullable=False),
        sa.Column("weights", sa.LargeBinary(), nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_drafters")),
    )


def downgrade() -> None:
    op.drop_table("drafters")
