"""File content in and out of the database: an upload copied into chunks (with the size and line limits), and a
stored file read back as a binary stream (for the batch-line parser, which reads it line by line).

Neither direction holds a file whole in memory: the upload is read CHUNK_BYTES at a time from Starlette's spooled
temporary file (itself at most 1 MB in memory, the rest on disk), and reading back fetches one chunk per query.
"""

from __future__ import annotations

import io
import uuid
from collections.abc import Iterator
from typing import BinaryIO

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.server.errors import too_large
from spec_batch.store import files as file_sql
from spec_batch.store.file_tables import CHUNK_BYTES, FILE_PROCESSED
from spec_batch.store.models import utcnow


def new_file_id() -> str:
    return "file-" + uuid.uuid4().hex[:24]


class LineCounter:
    """Counts lines across chunks: every newline ends one, and a last line without a newline counts too."""

    def __init__(self) -> None:
        self.newlines = 0
        self.last = b"\n"

    def feed(self, data: bytes) -> None:
        if data:
            self.newlines += data.count(b"\n")
            self.last = data[-1:]

    @property
    def lines(self) -> int:
        return self.newlines + (0 if self.last == b"\n" else 1)


def _check_limits(size: int, counter: LineCounter, max_bytes: int, max_lines: int) -> None:
    if size > max_bytes:
        raise too_large(
            f"the file is larger than {max_bytes} bytes, the most this server takes "
            f"(SPEC_BATCH_API_MAX_FILE_BYTES); split it into several batches",
            param="file",
        )
    if counter.lines > max_lines:
        raise too_large(
            f"the file has more than {max_lines} lines, the most a batch file may have "
            f"(SPEC_BATCH_API_MAX_FILE_LINES); split it into several batches",
            param="file",
        )


def store_upload(
    session_factory: sessionmaker[Session],
    source: BinaryIO,
    *,
    owner: str | None,
    filename: str,
    purpose: str,
    max_bytes: int,
    max_lines: int,
) -> str:
    """Copies `source` into a new file and its chunks in one transaction (a refused or failed upload leaves
    nothing). Raises a 413 APIError past max_bytes or max_lines, before reading further. Returns the file id."""
    file_id = new_file_id()
    size, counter = 0, LineCounter()
    with session_factory.begin() as s:
        file_sql.insert_file(
            s,
            id=file_id,
            owner=owner,
            purpose=purpose,
            filename=filename,
            bytes=0,
            line_count=0,
            status=FILE_PROCESSED,
            created_at=utcnow(),
        )
        seq = 0
        while data := source.read(CHUNK_BYTES):
            size += len(data)
            counter.feed(data)
            _check_limits(size, counter, max_bytes, max_lines)
            file_sql.add_chunk(s, file_id, seq, data)
            seq += 1
        row = file_sql.get_file(s, file_id, None)
        assert row is not None
        row.bytes, row.line_count = size, counter.lines
    return file_id


class ChunkReader(io.RawIOBase):
    """A stored file as a raw binary stream (wrap it in io.BufferedReader for readline)."""

    def __init__(self, session: Session, file_id: str) -> None:
        self._chunks = file_sql.iter_chunks(session, file_id)
        self._buffer = memoryview(b"")  # slices of a memoryview copy nothing

    def readable(self) -> bool:
        return True

    def readinto(self, target: bytearray | memoryview) -> int:  # type: ignore[override]
        while not self._buffer:
            nxt = next(self._chunks, None)
            if nxt is None:
                return 0
            self._buffer = memoryview(nxt)
        n = min(len(target), len(self._buffer))
        target[:n] = self._buffer[:n]
        self._buffer = self._buffer[n:]
        return n


def open_stored(session: Session, file_id: str) -> BinaryIO:
    """A buffered binary reader of the stored file (readline works)."""
    return io.BufferedReader(ChunkReader(session, file_id), buffer_size=1 << 16)  # type: ignore[return-value]


def iter_content(session_factory: sessionmaker[Session], file_id: str) -> Iterator[bytes]:
    """The stored file's bytes chunk by chunk, for a streamed download (its own session, held while streaming)."""
    with session_factory() as s:
        yield from file_sql.iter_chunks(s, file_id)
