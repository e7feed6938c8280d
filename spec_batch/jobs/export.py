"""A job's output files: OpenAI batch output lines for completed requests, error lines for the others."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from ..store import queries
from ..store.models import REQ_COMPLETED, REQUEST_DONE
from .batch_output import error_line, errors_path_for, output_line
from .output_guard import OutputPathError, check_output_path, refuse_non_regular

OUTPUT, ERROR, OPEN = "output", "error", "open"


def result_lines(session: Session, job_id: str) -> Iterator[tuple[str, str]]:
    """The job's rows in input order as (kind, JSON line with its newline): OUTPUT for a completed request, ERROR
    for a failed or cancelled one (invalid lines included), OPEN (an empty line) for one not finished. The one
    rendering of a job's files: `spec-batch run`'s files and the API's output and error files alike."""
    job = queries.get_job(session, job_id)
    model, drafter = job.target, job.drafter
    for r in queries.iter_requests(session, job_id):
        if r.status == REQ_COMPLETED:
            yield OUTPUT, json.dumps(output_line(r, model=model, drafter=drafter), ensure_ascii=False) + "\n"
        elif r.status in REQUEST_DONE:
            yield ERROR, json.dumps(error_line(r), ensure_ascii=False) + "\n"
        else:
            yield OPEN, ""


@dataclass
class ResultsReport:
    output_path: Path
    errors_path: Path | None
    n_output: int
    n_errors: int
    n_open: int  # requests not finished yet (not in either file)


def write_results(session_factory: sessionmaker[Session], job_id: str, out_path: str | Path) -> ResultsReport:
    """Writes the job's completed requests to out_path (OpenAI output lines, in input order) and its failed or
    cancelled ones, invalid lines included, to OUT.errors.jsonl (removed when there are none). Atomic per file."""
    out_path = Path(out_path)
    err_path = errors_path_for(out_path)
    refuse_non_regular(out_path, err_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out_path.with_name(f".{out_path.name}.tmp")
    tmp_err = err_path.with_name(f".{err_path.name}.tmp")
    n_out = n_err = n_open = 0
    with session_factory() as s:
        with open(tmp_out, "w", encoding="utf-8") as fo, open(tmp_err, "w", encoding="utf-8") as fe:
            for kind, text in result_lines(s, job_id):
                if kind == OUTPUT:
                    fo.write(text)
                    n_out += 1
                elif kind == ERROR:
                    fe.write(text)
                    n_err += 1
                else:
                    n_open += 1
    tmp_out.replace(out_path)
    if n_err:
        tmp_err.replace(err_path)
    else:
        tmp_err.unlink()
        if err_path.exists():
            err_path.unlink()  # a stale errors file of an earlier export to the same path
    return ResultsReport(out_path, err_path if n_err else None, n_out, n_err, n_open)


__all__ = [
    "ERROR",
    "OPEN",
    "OUTPUT",
    "OutputPathError",
    "ResultsReport",
    "check_output_path",
    "result_lines",
    "write_results",
]
