"""Tables of the Files and Batches API (migration 0008_files): uploaded files, their content in chunks, and the
batches (each one a job of the store, with what OpenAI's batch object adds: owner, endpoint, input file, errors).

File content lives in the database, not on a disk of one machine, so API replicas and queue workers on other
machines share nothing but the database (and Redis). A chunk holds at most CHUNK_BYTES, so reading or writing a
file never needs it whole in memory.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, ForeignKey, Integer, LargeBinary, String
from sqlalchemy.orm import Mapped, mapped_column

from .models import Base, JSONType, UTCDateTime, _in, utcnow
from .nul_safe import NulSafeString

CHUNK_BYTES = 1 << 20  # at most ~1 MB a row: fine for every backend's row and packet limits

# OpenAI's FileObject.status. A file is stored whole in one transaction, so it is never seen half-written.
FILE_PROCESSED = "processed"
FILE_ERROR = "error"
FILE_STATUSES = ("uploaded", FILE_PROCESSED, FILE_ERROR)
PURPOSE_BATCH = "batch"


class StoredFile(Base):
    """An uploaded file (purpose batch). Output and error files of batches are not stored: they are rendered
    from the job's rows on download."""

    __tablename__ = "files"
    __table_args__ = (CheckConstraint(_in("status", FILE_STATUSES), name="status"),)

    id: Mapped[str] = mapped_column(NulSafeString(40), primary_key=True)  # file-<hex>
    owner: Mapped[str | None] = mapped_column(String(80), index=True)  # the key's hash (auth.owner_hash); NULL: no keys
    purpose: Mapped[str] = mapped_column(NulSafeString(32))
    filename: Mapped[str] = mapped_column(NulSafeString(512))
    bytes: Mapped[int] = mapped_column(BigInteger)
    line_count: Mapped[int] = mapped_column(Integer)
    status: Mapped[str] = mapped_column(String(16), default=FILE_PROCESSED)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)


class FileChunk(Base):
    """One piece of a file's content, in order (seq 0, 1, ...)."""

    __tablename__ = "file_chunks"

    file_id: Mapped[str] = mapped_column(
        NulSafeString(40), ForeignKey("files.id", ondelete="CASCADE"), primary_key=True
    )
    seq: Mapped[int] = mapped_column(Integer, primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class Batch(Base):
    """A batch of the API: the job with the same id (the job holds the status, counts, timestamps, metadata)."""

    __tablename__ = "batches"

    id: Mapped[str] = mapped_column(
        NulSafeString(40), ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )  # batch_<hex>
    owner: Mapped[str | None] = mapped_column(String(80), index=True)
    input_file_id: Mapped[str] = mapped_column(
        NulSafeString(40)
    )  # not a foreign key: deleting the file keeps the batch
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    # Validation errors of a batch that failed while validating: [{"code", "message", "param", "line"}]
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    cancelling_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, index=True)
    # Its result files deleted (DELETE /v1/files/file-<id>-output / -errors; migration 0010): they no longer
    # resolve, the job's rows stay until the batch itself goes (retention).
    output_deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    errors_deleted_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
