"""Bulk jobs: batch files in and out, the runner, and the job service (create, measure, run, resume, cancel)."""
from .service import JobStateError, create_job_from_file, measure_baseline, resume_job, run_job, write_results

__all__ = ["JobStateError", "create_job_from_file", "measure_baseline", "resume_job", "run_job", "write_results"]
