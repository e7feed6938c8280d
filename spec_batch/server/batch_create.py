"""Creating a batch: store it `validating` (open_batch), then validate the uploaded file as OpenAI's Batch API does
and move it on (validate_batch: the API's BatchValidator does it after POST /v1/batches returned).

A structurally malformed file fails the whole batch while it is `validating`, with `errors` naming each line: a
line that is not JSON or not an object, a missing, bad or duplicate `custom_id`, a bad envelope (`method`, an
unknown top-level field), a `url` other than the batch's endpoint, a line over SPEC_BATCH_MAX_LINE_BYTES, or a
file over the line limit. A line whose envelope is right but whose `body` is not (a bad value, an unknown body
field) is a request that fails alone: it goes to the error file and the others run (as `spec-batch run` does).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.jobs import lifecycle
from spec_batch.jobs.batch_input import LineError, ParseReport, iter_lines, parse_lines
from spec_batch.jobs.service import sampling_defaults_with, store_validated
from spec_batch.server.file_io import open_stored
from spec_batch.store import files as file_sql
from spec_batch.store import queries
from spec_batch.store.models import utcnow

MAX_LISTED_ERRORS = 1000  # errors.data of a failed batch names at most this many lines (a row stays bounded)
BATCH_SIZE = 8  # rows decoded together: `spec-batch run`'s default, so a batch's outputs are run's
BASELINE_SAMPLE = 8  # requests measured without speculation for the speedup: run's default too


@dataclass(frozen=True)
class JobFields:
    """What the runner decides about a new batch's job: its models and precision, its queue (None: local),
    and the model's limits when they are known here."""

    target: str
    drafter: str
    queue: str | None = None
    chunk_size: int | None = None
    weights: str | None = None
    dtype: str | None = None
    max_context: int | None = None
    vocab_size: int | None = None


def new_batch_id() -> str:
    return "batch_" + uuid.uuid4().hex[:24]


def _error(code: str, message: str, param: str | None, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _line_url(raw: str) -> Any:
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj.get("url") if isinstance(obj, dict) else None


def _wrong_url(line: int, url: Any, endpoint: str) -> dict[str, Any]:
    return _error(
        "invalid_url",
        f"line {line}: url {url!r} differs from the batch's endpoint {endpoint!r}; every "
        f"line of a batch must use its endpoint",
        "url",
        line,
    )


def _structural(err: LineError) -> bool:
    """A line error of the envelope or the file (not of the body): the whole batch fails on it."""
    return not (err.param or "").startswith("body")


def structural_errors(report: ParseReport, endpoint: str, max_lines: int) -> list[dict[str, Any]]:
    """Every structural problem of the file, in line order (see the module docstring)."""
    found: list[dict[str, Any]] = []
    if report.n_lines == 0:
        found.append(_error("empty_file", "the file has no request line", None, None))
    if report.n_lines > max_lines:
        found.append(
            _error(
                "too_many_lines",
                f"the file has {report.n_lines} requests, more than the limit of "
                f"{max_lines} (SPEC_BATCH_API_MAX_FILE_LINES)",
                None,
                None,
            )
        )
    for entry in report.entries():
        if isinstance(entry, LineError):
            if _structural(entry):
                found.append(entry.to_error())
            elif _line_url(entry.raw) != endpoint:
                found.append(_wrong_url(entry.line_number, _line_url(entry.raw), endpoint))
        elif entry.endpoint != endpoint:
            found.append(_wrong_url(entry.line_number, entry.endpoint, endpoint))
    return found


def parse_stored(session_factory: sessionmaker[Session], file_id: str, max_line_bytes: int) -> ParseReport:
    """The stored file's lines through the batch-line parser, read from its chunks line by line."""
    with session_factory() as s:
        reader = open_stored(s, file_id)
        return parse_lines(
            iter_lines(reader, max_line_bytes), defaults=sampling_defaults_with(None), max_bytes=max_line_bytes
        )


def _capped(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if len(errors) <= MAX_LISTED_ERRORS:
        return errors
    rest = len(errors) - MAX_LISTED_ERRORS
    return errors[:MAX_LISTED_ERRORS] + [_error("more_errors", f"{rest} more line(s) have errors", None, None)]


def open_batch(
    session_factory: sessionmaker[Session],
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, Any] | None,
    owner: str | None,
    fields: JobFields,
) -> str:
    """Stores a new batch, `validating`, before its file is read: its job (no request rows yet) and its batch row,
    in one transaction. validate_batch moves it on. Returns its id."""
    batch_id = new_batch_id()
    now = utcnow()
    with session_factory.begin() as s:
        queries.insert_job(
            s,
            id=batch_id,
            target=fields.target,
            drafter=fields.drafter,
            input_file=input_file_id,
            sampling_defaults=sampling_defaults_with(None),
            user_metadata=metadata,
            batch_size=BATCH_SIZE,
            baseline_sample=BASELINE_SAMPLE,
            chunk_size=fields.chunk_size,
            queue=fields.queue,
            weights=fields.weights,
            dtype=fields.dtype,
            n_requests=0,
            created_at=now,
        )
        file_sql.insert_batch(
            s,
            id=batch_id,
            owner=owner,
            input_file_id=input_file_id,
            endpoint=endpoint,
            completion_window=completion_window,
            created_at=now,
        )
    return batch_id


def _fail(session_factory: sessionmaker[Session], batch_id: str, error: str, errors: list[dict[str, Any]]) -> bool:
    """validating -> failed with `errors` on the batch row, in one transaction (only from validating)."""
    with session_factory.begin() as s:
        failed = lifecycle.fail_validating(s, batch_id, error)
        if failed and errors:
            file_sql.set_batch_errors(s, batch_id, _capped(errors))
    return failed


def validate_batch(
    session_factory: sessionmaker[Session], batch_id: str, fields: JobFields, *, max_line_bytes: int, max_lines: int
) -> bool:
    """Validates the file of a batch stored by open_batch and moves it on: in_progress with its request rows
    (written in the transaction that starts it), or failed with `errors` naming the lines. False when the batch had
    left validating already (cancelled, or validated by another process): nothing is done. An unexpected error
    fails the batch (never left validating) and is raised."""
    with session_factory() as s:
        found = file_sql.get_batch(s, batch_id, None)
        if found is None or not lifecycle.is_validating(found[1].status):
            return False
        input_file_id, endpoint = found[0].input_file_id, found[0].endpoint
    try:
        report = parse_stored(session_factory, input_file_id, max_line_bytes)
        report.check_model_limits(max_context=fields.max_context, vocab_size=fields.vocab_size)
        errors = structural_errors(report, endpoint, max_lines)
        if errors:
            message = f"the input file failed validation ({len(errors)} error(s); first: {errors[0]['message']})"
            return _fail(session_factory, batch_id, message, errors)
        return store_validated(session_factory, batch_id, report, input_name=input_file_id)
    except Exception as exc:
        _fail(session_factory, batch_id, f"validation failed in the server: {type(exc).__name__}: {exc}", [])
        raise


def create_batch(
    session_factory: sessionmaker[Session],
    *,
    input_file_id: str,
    endpoint: str,
    completion_window: str,
    metadata: dict[str, Any] | None,
    owner: str | None,
    fields: JobFields,
    max_line_bytes: int,
    max_lines: int,
) -> str:
    """open_batch then validate_batch, here and now. Returns its id; the job is in_progress, or failed (validation
    errors, or no valid line)."""
    batch_id = open_batch(
        session_factory,
        input_file_id=input_file_id,
        endpoint=endpoint,
        completion_window=completion_window,
        metadata=metadata,
        owner=owner,
        fields=fields,
    )
    validate_batch(session_factory, batch_id, fields, max_line_bytes=max_line_bytes, max_lines=max_lines)
    return batch_id
