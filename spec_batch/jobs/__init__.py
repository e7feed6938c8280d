"""Bulk jobs: batch files in and out, the runner, and the job service (create, measure, run, resume, cancel)."""
from .service import create_job_from_file, measure_baseline, resume_job, run_job, write_results

__all__ = ["create_job_from_file", "measure_baseline", "resume_job", "run_job", "write_results"]
