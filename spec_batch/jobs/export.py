"""A job's output files: OpenAI batch output lines for completed requests, error lines for the others."""
from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecBatchError
from ..store import queries
from ..store.models import REQ_COMPLETED, REQUEST_DONE
from .batch_output import error_line, errors_path_for, output_line


class OutputPathError(SpecBatchError):
    """An output path that would replace the input, overwrite a file without --force, or cannot be written."""


def check_output_path(out_path: str | Path, *, input_path: str | Path | None = None, force: bool = False) -> None:
    """Checks, before any work, that results can go to out_path and OUT.errors.jsonl: neither is the input file,
    neither exists unless `force`, and the folder exists (or can be made) and takes new files."""
    out_path = Path(out_path)
    targets = [out_path, errors_path_for(out_path)]
    if input_path is not None:
        src = Path(input_path).resolve()
        for t in targets:
            if t.resolve() == src:
                raise OutputPathError(
                    f"{t} is the input file: writing results there would replace the requests; choose another -o"
                )
    if out_path.is_dir():
        raise OutputPathError(f"{out_path} is a folder: -o names the output file (OUT.jsonl)")
    existing = [str(t) for t in targets if t.exists()]
    if existing and not force:
        raise OutputPathError(
            f"{' and '.join(existing)} already exist{'s' if len(existing) == 1 else ''}: pass --force to replace "
            f"{'it' if len(existing) == 1 else 'them'}, or choose another -o"
        )
    folder = out_path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".probe", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"cannot write the output {out_path}: {exc.strerror or exc}") from exc


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
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp_out = out_path.with_name(f".{out_path.name}.tmp")
    tmp_err = err_path.with_name(f".{err_path.name}.tmp")
    n_out = n_err = n_open = 0
    with session_factory() as s:
        job = queries.get_job(s, job_id)
        model, drafter = job.target, job.drafter
        with open(tmp_out, "w", encoding="utf-8") as fo, open(tmp_err, "w", encoding="utf-8") as fe:
            for r in queries.iter_requests(s, job_id):
                if r.status == REQ_COMPLETED:
                    fo.write(json.dumps(output_line(r, model=model, drafter=drafter), ensure_ascii=False) + "\n")
                    n_out += 1
                elif r.status in REQUEST_DONE:
                    fe.write(json.dumps(error_line(r), ensure_ascii=False) + "\n")
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


__all__ = ["OutputPathError", "ResultsReport", "check_output_path", "write_results"]
