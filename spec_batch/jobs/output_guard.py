"""Where a command may write a file: the one guard every writing command (`run`, `results`, `wait -o`, `report`)
calls before any work, and the atomic write they all end with.

A command refuses, before any model loads:
- a path that exists and is not a regular file (a folder, a device such as /dev/full, a FIFO, a socket), even
  with --force: an atomic write would rename a new regular file over it;
- the input file of the command or of a job it is about, and a job's errors file (OUT.errors.jsonl), even with
  --force: they are the job's data;
- an existing regular file without --force;
- a folder that cannot be made or written.
"""

from __future__ import annotations

import os
import stat
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecBatchError
from ..store import queries
from .batch_output import errors_path_for


class OutputPathError(SpecBatchError):
    """An output path that would replace the input, overwrite a file without --force, or cannot be written."""


_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
)


def not_a_regular_file(path: str | Path) -> str | None:
    """What path is when it exists and is not a regular file ("a folder", "a character device", ...); else None.
    Symbolic links are followed: a link to a device is a device."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return None  # a new file (or a dangling link, which the write replaces)
    except OSError:
        return None  # unreadable: the write itself will say why
    if stat.S_ISREG(mode):
        return None
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def _same(a: Path, b: str | Path) -> bool:
    return a.resolve() == Path(b).resolve()


def job_files(
    session_factory: sessionmaker[Session], job_ids: Iterable[str], *, outputs: bool = False
) -> dict[Path, str]:
    """{path: what it is} of the jobs' input and errors files (and results files with outputs=True): files a
    command must never replace with something else."""
    files: dict[Path, str] = {}
    with session_factory() as s:
        for job_id in job_ids:
            job = queries.get_job(s, job_id)
            if job.input_file:
                files[Path(job.input_file)] = f"the input file of job {job_id}"
            if job.output_file:
                files[errors_path_for(job.output_file)] = f"the errors file of job {job_id}"
                if outputs:
                    files[Path(job.output_file)] = f"the results file of job {job_id}"
    return files


def check_target(
    path: str | Path, *, protected: Mapping[Path, str] | None = None, force: bool = False, option: str = "-o"
) -> None:
    """One file a command is about to write: refused when it is protected (always), not a regular file (always)
    or exists without `force`."""
    path = Path(path)
    for other, what in (protected or {}).items():
        if _same(path, other):
            raise OutputPathError(f"{path} is {what}: spec-batch never replaces it; choose another {option}")
    kind = not_a_regular_file(path)
    if kind == "a folder":
        raise OutputPathError(f"{path} is a folder: {option} names a file to write")
    if kind is not None:
        raise OutputPathError(
            f"{path} is {kind}, not a regular file: spec-batch writes only regular files "
            f"(--force does not change that); choose another {option}"
        )
    if path.exists() and not force:
        raise OutputPathError(f"{path} already exists: pass --force to replace it, or choose another {option}")


def check_folder(path: str | Path) -> None:
    """The folder of path exists (or can be made) and takes new files."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".probe", dir=path.parent)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise OutputPathError(f"cannot write the output {path}: {exc.strerror or exc}") from exc


def check_output_path(
    out_path: str | Path,
    *,
    input_path: str | Path | None = None,
    protected: Mapping[Path, str] | None = None,
    force: bool = False,
) -> None:
    """Checks, before any work, that results can go to out_path and OUT.errors.jsonl beside it: neither is the
    input file, out_path is none of the `protected` files (job_files), both are regular files or new ones, neither
    exists unless `force`, and the folder exists (or can be made) and takes new files."""
    out_path = Path(out_path)
    err_path = errors_path_for(out_path)
    if input_path is not None:
        for t in (out_path, err_path):
            if _same(t, input_path):
                raise OutputPathError(
                    f"{t} is the input file: writing results there would replace the requests; choose another -o"
                )
    check_target(out_path, protected=protected, force=force)
    # The errors file beside a job's own output is that job's errors file: a re-export (with --force) rewrites it.
    inputs_only = {p: w for p, w in (protected or {}).items() if "input file" in w}
    check_target(err_path, protected=inputs_only, force=force)
    check_folder(out_path)


def refuse_non_regular(*paths: str | Path) -> None:
    """Raises OSError when one of paths exists and is not a regular file: the last check before a write renames
    a new file over it (the command checked earlier; this holds for finalizing workers and files that changed)."""
    for path in paths:
        kind = not_a_regular_file(path)
        if kind is not None:
            raise OSError(f"{path} is {kind}, not a regular file: results are written only to regular files")


def write_text_atomically(path: str | Path, text: str) -> None:
    """Writes text to path through a temporary file and a rename: a reader never sees half a file, and a failed
    write leaves the previous one. Refuses a path that is not a regular file (OSError)."""
    path = Path(path)
    refuse_non_regular(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


__all__ = [
    "OutputPathError",
    "check_folder",
    "check_output_path",
    "check_target",
    "job_files",
    "not_a_regular_file",
    "refuse_non_regular",
    "write_text_atomically",
]
