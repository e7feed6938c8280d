"""SQLAlchemy 2.x tables of the store: jobs, their requests, queue chunks and baseline samples (every table here).

Alembic migrations in ``migrations/`` are the only way this schema changes: edit these classes, then add a
migration (``alembic revision -m ...``) that makes the same change, with a working downgrade.

The ``job_summary`` view is not part of this metadata (``create_all`` must not create it); it is created by
migration 0001 and described for queries by :data:`job_summary` below.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    TypeDecorator,
    UniqueConstraint,
    false,
    text,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from .nul_safe import NulSafeJSON, NulSafeString, NulSafeText

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# Job lifecycle, as OpenAI's Batch API: validating -> in_progress -> finalizing -> completed;
# failed (the job as a whole: e.g. no valid line); cancelling -> cancelled; expired (a batch of the API not
# finished within its completion_window, migration 0010).
JOB_VALIDATING = "validating"
JOB_IN_PROGRESS = "in_progress"
JOB_FINALIZING = "finalizing"
JOB_COMPLETED = "completed"
JOB_FAILED = "failed"
JOB_CANCELLING = "cancelling"
JOB_CANCELLED = "cancelled"
JOB_EXPIRED = "expired"
JOB_STATUSES = (
    JOB_VALIDATING,
    JOB_IN_PROGRESS,
    JOB_FINALIZING,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_CANCELLING,
    JOB_CANCELLED,
    JOB_EXPIRED,
)
JOB_TERMINAL = (JOB_COMPLETED, JOB_FAILED, JOB_CANCELLED, JOB_EXPIRED)

REQ_PENDING = "pending"
REQ_RUNNING = "running"
REQ_COMPLETED = "completed"
REQ_FAILED = "failed"
REQ_CANCELLED = "cancelled"
REQUEST_STATUSES = (REQ_PENDING, REQ_RUNNING, REQ_COMPLETED, REQ_FAILED, REQ_CANCELLED)
REQUEST_OPEN = (REQ_PENDING, REQ_RUNNING)  # not finished yet
REQUEST_DONE = (REQ_COMPLETED, REQ_FAILED, REQ_CANCELLED)


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator):
    """A timezone-aware UTC timestamp on every backend (SQLite stores no offset: it is UTC by convention)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: spec-batch stores timezone-aware UTC timestamps")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


# JSON (JSONB on PostgreSQL) whose strings may hold NUL (nul_safe.py): every JSON column of the store.
JSONType = NulSafeJSON()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Job(Base):
    """One bulk job: a batch file's requests, the models that ran them and the job's measured speedup."""

    __tablename__ = "jobs"
    __table_args__ = (CheckConstraint(_in("status", JOB_STATUSES), name="status"),)

    id: Mapped[str] = mapped_column(NulSafeString(40), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), default=JOB_VALIDATING, server_default=JOB_VALIDATING, index=True)
    target: Mapped[str] = mapped_column(NulSafeString(512))
    drafter: Mapped[str] = mapped_column(NulSafeString(512))
    input_file: Mapped[str | None] = mapped_column(NulSafeString(1024))
    output_file: Mapped[str | None] = mapped_column(NulSafeString(1024))
    # Defaults for lines that omit a value: {"max_new_tokens": .., "temperature": .., "top_p": ..}
    sampling_defaults: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    user_metadata: Mapped[dict[str, Any] | None] = mapped_column("metadata", JSONType)
    batch_size: Mapped[int] = mapped_column(Integer, default=8, server_default="8")
    baseline_sample: Mapped[int] = mapped_column(Integer, default=8, server_default="8")  # 0: no baseline, speedup NULL
    chunk_size: Mapped[int | None] = mapped_column(Integer)  # queue: requests per task
    queue: Mapped[str | None] = mapped_column(String(128))  # queue: Celery queue name; NULL = in-process
    # The precision the job runs at (loading/weights.py): full | int8 | int4, and the compute dtype. NULL: older
    # jobs (full), or a queued job whose dtype is the worker device's default.
    weights: Mapped[str | None] = mapped_column(String(16))
    dtype: Mapped[str | None] = mapped_column(String(16))
    # Request counts fixed at creation: every non-blank line, and those that failed validation.
    n_requests: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    n_invalid: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Seconds spent inside decoder.generate() storing this job's results, summed over runs and workers.
    decode_wall_s: Mapped[float] = mapped_column(Float, default=0.0, server_default="0")
    # The measured baseline: the same sample of requests decoded with and without speculation
    # (same engine, same batch size); speedup = (sample tokens/s) / (baseline tokens/s).
    baseline_requests: Mapped[int | None] = mapped_column(Integer)
    baseline_output_tokens: Mapped[int | None] = mapped_column(Integer)
    baseline_wall_s: Mapped[float | None] = mapped_column(Float)
    sample_output_tokens: Mapped[int | None] = mapped_column(Integer)
    sample_wall_s: Mapped[float | None] = mapped_column(Float)
    # The lowest and highest ratio of the baseline's interleaved rounds (0006): a wide range (see
    # spec_batch.jobs.baseline.UNRELIABLE_SPREAD) means the load changed while the speedup was measured.
    speedup_low: Mapped[float | None] = mapped_column(Float)
    speedup_high: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(NulSafeText)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # in_progress since
    finalizing_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    failed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    cancelled_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expired_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # 0010

    requests: Mapped[list[Request]] = relationship(
        back_populates="job", cascade="all, delete-orphan", passive_deletes=True, order_by="Request.line_number"
    )

    def __repr__(self) -> str:
        return f"Job(id={self.id!r}, status={self.status!r}, target={self.target!r}, drafter={self.drafter!r})"


class Request(Base):
    """One line of a batch file. Invalid lines are rows too (status failed, error_code set, no prompt)."""

    __tablename__ = "requests"
    __table_args__ = (
        # custom_ids are unique among a job's valid rows; an invalid line keeps its own, even a duplicate (0005)
        Index(
            "uq_requests_job_id_custom_id_valid",
            "job_id",
            "custom_id",
            unique=True,
            sqlite_where=text("endpoint IS NOT NULL"),
            postgresql_where=text("endpoint IS NOT NULL"),
        ),
        UniqueConstraint("job_id", "line_number"),
        CheckConstraint(_in("status", REQUEST_STATUSES), name="status"),
        Index("ix_requests_job_id_status", "job_id", "status"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(NulSafeString(40), ForeignKey("jobs.id", ondelete="CASCADE"))
    # The line's custom_id when it has a string one (invalid lines too); NULL when it has none.
    custom_id: Mapped[str | None] = mapped_column(NulSafeString(512))
    line_number: Mapped[int] = mapped_column(Integer)  # 1-based line of the batch file
    input: Mapped[str] = mapped_column(NulSafeText)  # the line exactly as read
    endpoint: Mapped[str | None] = mapped_column(NulSafeString(64))  # "/v1/chat/completions" | "/v1/completions"
    prompt: Mapped[Any] = mapped_column(JSONType, nullable=True)  # messages (chat) or prompt string
    params: Mapped[dict[str, Any] | None] = mapped_column(JSONType)  # SamplingParams fields
    # What the line asked for beyond SamplingParams (0005): {"n", "tools", "logprobs", "recorded": {...}}; NULL: none
    options: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    status: Mapped[str] = mapped_column(String(16), default=REQ_PENDING, server_default=REQ_PENDING)
    output: Mapped[str | None] = mapped_column(NulSafeText)  # generated text (the first choice's)
    # The choices when `output` is not enough (0005): n > 1, logprobs; see jobs/choices.py. NULL: one plain choice
    choices: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONType)
    finish_reason: Mapped[str | None] = mapped_column(String(16))  # stop | length | error
    error_code: Mapped[str | None] = mapped_column(String(64))
    error_param: Mapped[str | None] = mapped_column(NulSafeString(255))  # the field an invalid line got wrong
    error: Mapped[str | None] = mapped_column(NulSafeText)
    # Per-request statistics from the core (RequestStats).
    prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    output_tokens: Mapped[int | None] = mapped_column(Integer)
    draft_tokens: Mapped[int | None] = mapped_column(Integer)
    accepted_tokens: Mapped[int | None] = mapped_column(Integer)
    target_forwards: Mapped[int | None] = mapped_column(Integer)
    draft_forwards: Mapped[int | None] = mapped_column(Integer)
    accepted_length_histogram: Mapped[list[int] | None] = mapped_column(JSONType)
    forced_tokens: Mapped[int | None] = mapped_column(Integer)  # tokens a grammar allowed alone (0003)
    drafted_per_position: Mapped[list[int] | None] = mapped_column(JSONType)  # steps that drafted position j
    accepted_per_position: Mapped[list[int] | None] = mapped_column(JSONType)  # steps that accepted position j
    wall_s: Mapped[float | None] = mapped_column(Float)
    # Who ran it and when.
    worker: Mapped[str | None] = mapped_column(String(255))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    completed_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    job: Mapped[Job] = relationship(back_populates="requests")

    def __repr__(self) -> str:
        return f"Request(id={self.id!r}, job_id={self.job_id!r}, custom_id={self.custom_id!r}, status={self.status!r})"


# ---------------------------------------------------------------- the queue (migration 0002)

CHUNK_QUEUED = "queued"
CHUNK_RUNNING = "running"
CHUNK_DONE = "done"
CHUNK_SPLIT = "split"
CHUNK_STATES = (CHUNK_QUEUED, CHUNK_RUNNING, CHUNK_DONE, CHUNK_SPLIT)
CHUNK_LIVE = (CHUNK_QUEUED, CHUNK_RUNNING)  # a message exists or a worker holds it


class QueueChunk(Base):
    """Requests of one job published together as one Celery task (its id is the task id)."""

    __tablename__ = "queue_chunks"
    __table_args__ = (
        CheckConstraint(_in("state", CHUNK_STATES), name="state"),
        Index("ix_queue_chunks_state_lease_expires_at", "state", "lease_expires_at"),
    )

    id: Mapped[str] = mapped_column(String(36), primary_key=True)  # the Celery task id
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)  # order within the job (split pieces get new numbers)
    queue: Mapped[str] = mapped_column(String(128))
    request_ids: Mapped[list[int]] = mapped_column(JSONType)
    measure_baseline: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    state: Mapped[str] = mapped_column(String(16), default=CHUNK_QUEUED, server_default=CHUNK_QUEUED)
    epoch: Mapped[str | None] = mapped_column(String(64))
    worker: Mapped[str | None] = mapped_column(String(255))
    attempts: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    published_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    def __repr__(self) -> str:
        return f"QueueChunk(id={self.id!r}, job_id={self.job_id!r}, seq={self.seq}, state={self.state!r})"


# ---------------------------------------------------------------- the baseline sample, request by request (0004)


class BaselineSample(Base):
    """One sampled request of a job's baseline: its tokens and seconds with and without speculation."""

    __tablename__ = "baseline_samples"

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    request_id: Mapped[int] = mapped_column(ForeignKey("requests.id", ondelete="CASCADE"), unique=True)
    speculative_output_tokens: Mapped[int] = mapped_column(Integer)
    speculative_target_forwards: Mapped[int] = mapped_column(Integer)
    speculative_wall_s: Mapped[float] = mapped_column(Float)
    baseline_output_tokens: Mapped[int] = mapped_column(Integer)  # without speculation: one token per step
    baseline_wall_s: Mapped[float] = mapped_column(Float)

    def __repr__(self) -> str:
        return f"BaselineSample(job_id={self.job_id!r}, request_id={self.request_id!r})"


# The job_summary view, for typed queries (select(job_summary)); created by the migrations (0001, extended in
# 0003), not create_all.
view_metadata = MetaData()
job_summary = Table(
    "job_summary",
    view_metadata,
    Column("job_id", String(40), primary_key=True),
    Column("status", String(16)),
    Column("target", String(512)),
    Column("drafter", String(512)),
    Column("n_requests", Integer),
    Column("n_completed", Integer),
    Column("n_failed", Integer),
    Column("output_tokens", Integer),
    Column("acceptance_rate", Float),
    Column("tokens_per_step", Float),
    Column("tokens_per_s", Float),
    Column("baseline_tokens_per_s", Float),
    Column("speedup", Float),
    Column("created_at", UTCDateTime),
    Column("completed_at", UTCDateTime),
    Column("forced_tokens", Integer),  # appended by migration 0003
    Column("speedup_low", Float),  # appended by migration 0006
    Column("speedup_high", Float),
    Column("speedup_reliable", Boolean),  # NULL when no range was measured
)
JOB_SUMMARY_COLUMNS = tuple(c.name for c in job_summary.columns)
