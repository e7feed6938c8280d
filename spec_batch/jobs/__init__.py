"""Bulk jobs: batch files in and out, the runner, and the job service (create, measure, run, resume, cancel)."""

from .baseline import measure_baseline
from .export import ResultsReport, write_results
from .service import (
    JobBusyError,
    JobStateError,
    cancel_job,
    create_job_from_file,
    job_info,
    resume,
    resume_job,
    run_job,
    validate_file,
)

__all__ = [
    "JobBusyError",
    "JobStateError",
    "ResultsReport",
    "cancel_job",
    "create_job_from_file",
    "job_info",
    "measure_baseline",
    "resume",
    "resume_job",
    "run_job",
    "validate_file",
    "write_results",
]
