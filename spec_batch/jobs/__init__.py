"""Bulk jobs: batch files in and out, the runner, and the job service (create, measure, run, resume, cancel)."""
from .export import ResultsReport, write_results
from .service import (
    JobStateError,
    cancel_job,
    create_job_from_file,
    measure_baseline,
    resume,
    resume_job,
    run_job,
)

__all__ = [
    "JobStateError",
    "ResultsReport",
    "cancel_job",
    "create_job_from_file",
    "measure_baseline",
    "resume",
    "resume_job",
    "run_job",
    "write_results",
]
