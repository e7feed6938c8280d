"""Creating a job: a batch file validated, the job and its request rows stored in one transaction (invalid lines
are failed rows with their line number and reason), or a job stored while `validating` and its rows written once
its file was validated (the API's batches). The job service (service.py) re-exports these names."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.params import SamplingParams
from ..store import queries
from ..store.models import REQ_FAILED, REQ_PENDING, utcnow
from . import lifecycle
from .batch_input import DEFAULT_SAMPLING, BatchRequest, ParseReport, read_batch_file


def new_job_id() -> str:
    return "job_" + uuid.uuid4().hex[:16]


def sampling_defaults_with(overrides: dict[str, Any] | None) -> dict[str, Any]:
    """The job's sampling defaults: DEFAULT_SAMPLING with `overrides`; unknown keys or bad values raise here."""
    defaults = {**DEFAULT_SAMPLING, **(overrides or {})}
    SamplingParams.from_dict(defaults)
    return defaults


def validate_file(path: str | Path, sampling_defaults: dict[str, Any] | None = None) -> ParseReport:
    """Reads and validates a batch file without storing anything (OSError when it cannot be read)."""
    return read_batch_file(path, defaults=sampling_defaults_with(sampling_defaults))


def _request_rows(job_id: str, report: ParseReport, now: Any) -> list[dict[str, Any]]:
    """One requests row per non-blank line: pending for a valid one, failed (with its error) for an invalid one."""
    rows = []
    for entry in report.entries():
        if isinstance(entry, BatchRequest):
            rows.append(
                {
                    "job_id": job_id,
                    "custom_id": entry.custom_id,
                    "line_number": entry.line_number,
                    "input": entry.raw,
                    "endpoint": entry.endpoint,
                    "prompt": entry.prompt,
                    "params": entry.params.to_dict(),
                    "options": entry.options,
                    "status": REQ_PENDING,
                    "attempts": 0,
                }
            )
        else:
            rows.append(
                {
                    "job_id": job_id,
                    "custom_id": entry.custom_id,  # kept: unique only among valid rows
                    "line_number": entry.line_number,
                    "input": entry.raw,
                    "endpoint": None,
                    "prompt": None,
                    "params": None,
                    "status": REQ_FAILED,
                    "finish_reason": "error",
                    "error_code": entry.code,
                    "error_param": entry.param,
                    "error": entry.message,
                    "attempts": 0,
                    "completed_at": now,
                }
            )
    return rows


def create_job_from_file(
    session_factory: sessionmaker[Session],
    path: str | Path,
    *,
    target: str,
    drafter: str,
    output_file: str | Path | None = None,
    batch_size: int = 8,
    baseline_sample: int = 8,
    sampling_defaults: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    queue: str | None = None,
    chunk_size: int | None = None,
    job_id: str | None = None,
    report: ParseReport | None = None,
    max_context: int | None = None,
    vocab_size: int | None = None,
    weights: str | None = None,
    dtype: str | None = None,
    input_name: str | None = None,
    also: Callable[[Session], None] | None = None,
) -> tuple[str, ParseReport]:
    """Validates the file and stores the job, one request row per non-blank line (invalid lines are failed rows
    with their line number and reason). Status in_progress, or failed when no line is valid. report: the file
    already validated by validate_file (not read again). max_context / vocab_size: the target's, when known (lines
    it cannot run are invalid lines too). input_name: the input the job records instead of the file's path (the
    API's file id). also(session): more rows (the API's batch row) in the one transaction of the job and its
    requests: a failure leaves none. Raises OSError when the file cannot be read, ValueError for bad options."""
    _check_job_options(batch_size, baseline_sample)
    defaults = sampling_defaults_with(sampling_defaults)
    if report is None:
        report = read_batch_file(path, defaults=defaults)
    report.check_model_limits(max_context=max_context, vocab_size=vocab_size)
    job_id = job_id or new_job_id()
    now = utcnow()
    with session_factory.begin() as s:
        queries.insert_job(
            s,
            id=job_id,
            target=target,
            drafter=drafter,
            input_file=input_name or str(Path(path).resolve()),
            output_file=str(Path(output_file).resolve()) if output_file else None,
            sampling_defaults=defaults,
            user_metadata=metadata,
            batch_size=batch_size,
            baseline_sample=baseline_sample,
            chunk_size=chunk_size,
            queue=queue,
            weights=weights,
            dtype=dtype,
            n_requests=report.n_lines,
            n_invalid=len(report.errors),
            created_at=now,
        )
        queries.insert_requests(s, _request_rows(job_id, report, now))
        _leave_validating(s, job_id, path, report, now)
        if also is not None:
            also(s)
    return job_id, report


class _LeftValidating(Exception):
    """The job left validating while its file was validated: the transaction is rolled back."""


def store_validated(
    session_factory: sessionmaker[Session],
    job_id: str,
    report: ParseReport,
    *,
    input_name: str,
) -> bool:
    """For a job stored while `validating` before its file was read (a batch of the API): in one transaction, the
    job leaves validating (in_progress, or failed when no line is valid) and its line counts and request rows are
    written. Only from validating: when the job left it meanwhile (cancelled, or another
    process validating it too got there first), nothing is written and False is returned."""
    now = utcnow()
    try:
        with session_factory.begin() as s:
            # the status first: on PostgreSQL it locks the row, so a second validator waits, then finds it gone
            if report.requests:
                moved = lifecycle.start(s, job_id, now=now)
            else:
                moved = lifecycle.fail_validating(s, job_id, _no_valid_line(input_name, report), now=now)
            if not moved:
                raise _LeftValidating()
            queries.set_job_sizes(s, job_id, n_requests=report.n_lines, n_invalid=len(report.errors))
            queries.insert_requests(s, _request_rows(job_id, report, now))
    except _LeftValidating:
        return False
    return True


def _no_valid_line(path: str | Path, report: ParseReport) -> str:
    if report.n_lines:
        return f"no valid request in {path} ({report.n_lines} line(s), all invalid: see the errors file)"
    return f"{path} has no requests"


def _check_job_options(batch_size: int, baseline_sample: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if baseline_sample < 0:
        raise ValueError(f"baseline_sample must be >= 0 (0 turns the baseline off), got {baseline_sample}")


def _leave_validating(session: Session, job_id: str, path: str | Path, report: ParseReport, now: Any) -> None:
    """The stored job starts (it has valid lines) or fails as a whole (none)."""
    if report.requests:
        lifecycle.start(session, job_id, now=now)
        return
    lifecycle.fail(session, job_id, _no_valid_line(path, report), now=now)
