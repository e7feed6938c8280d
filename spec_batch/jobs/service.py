"""The job service: create a job from a batch file, measure its baseline, run, resume and cancel it.

Used by the CLI (``spec-batch run / resume / cancel``) and by the queue (workers/), which reuses
create_job_from_file and measure_baseline and runs requests with ``spec_batch.jobs.runner.run_requests``.
The service never talks to the broker: a caller that resumes a queued job passes the queue's enqueue function.
"""
from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..core.outputs import RequestStats
from ..core.params import SamplingParams
from ..errors import SpecBatchError
from ..store import chunks as qstore
from ..store import queries
from ..store.baselines import SamplePair, record_baseline_samples
from ..store.models import (
    JOB_CANCELLED,
    JOB_CANCELLING,
    JOB_COMPLETED,
    JOB_FAILED,
    JOB_FINALIZING,
    JOB_IN_PROGRESS,
    JOB_TERMINAL,
    JOB_VALIDATING,
    REQ_FAILED,
    REQ_PENDING,
    REQ_RUNNING,
    utcnow,
)
from .batchfile import DEFAULT_SAMPLING, BatchRequest, ParseReport, read_batch_file
from ..settings import get_settings
from .export import write_results
from .lease import Holder, LeaseKeeper, new_token, take_over_dead_holders
from .runner import OnStored, RunReport, build_prompt, run_requests


class JobStateError(SpecBatchError):
    """A job cannot do what was asked in its current status."""


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
) -> tuple[str, ParseReport]:
    """Validates the file and stores the job with one request row per non-blank line (invalid lines are
    failed rows with their line number and reason). Status in_progress, or failed when no line is valid.

    report: the file already validated by validate_file (it is not read again). max_context / vocab_size: the
    target's, when known: lines it cannot run (max_tokens beyond its context, token ids outside its
    vocabulary) are invalid lines too. Raises OSError when the file cannot be read, ValueError for bad options.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if baseline_sample < 0:
        raise ValueError(f"baseline_sample must be >= 0 (0 turns the baseline off), got {baseline_sample}")
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
            status=JOB_VALIDATING,
            target=target,
            drafter=drafter,
            input_file=str(Path(path).resolve()),
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
    with session_factory.begin() as s:
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
                        "params": entry.params_dict(),
                        "status": REQ_PENDING,
                        "attempts": 0,
                    }
                )
            else:
                rows.append(
                    {
                        "job_id": job_id,
                        "custom_id": None,
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
        queries.insert_requests(s, rows)
        if report.requests:
            queries.set_job_status(s, job_id, JOB_IN_PROGRESS, now=now)
        else:
            queries.fail_job(
                s, job_id,
                f"no valid request in {path} ({report.n_lines} line(s), all invalid: see the errors file)"
                if report.n_lines else f"{path} has no requests",
                now=now,
            )
    return job_id, report


# ---------------------------------------------------------------- baseline

WARMUP_TOKENS = 16  # per sampled request, decoded untimed by both decoders before the baseline is timed


@dataclass
class Baseline:
    n_requests: int
    baseline_output_tokens: int
    baseline_wall_s: float
    sample_output_tokens: int
    sample_wall_s: float
    stored: int = 0  # speculative sample results stored as the requests' results

    @property
    def baseline_tokens_per_s(self) -> float | None:
        return RequestStats(output_tokens=self.baseline_output_tokens, wall_s=self.baseline_wall_s).tokens_per_s

    @property
    def sample_tokens_per_s(self) -> float | None:
        return RequestStats(output_tokens=self.sample_output_tokens, wall_s=self.sample_wall_s).tokens_per_s

    @property
    def speedup(self) -> float | None:
        a, b = self.sample_tokens_per_s, self.baseline_tokens_per_s
        return a / b if a is not None and b else None


def choose_sample(ids: Sequence[int], k: int) -> list[int]:
    """k ids spread evenly over `ids` (all of them when k >= len(ids)); deterministic."""
    n = len(ids)
    if k >= n:
        return list(ids)
    return [ids[(i * n) // k] for i in range(k)]


def measure_baseline(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    *,
    sample_size: int | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
    on_stored: OnStored | None = None,
) -> Baseline | None:
    """Measures the job's speedup on a sample of its valid requests: decodes the sample with the job's decoder
    and then with decoder.without_speculation() (same engine, same batch size), timing each generate() call,
    and stores both on the job (first measurement wins), with each sampled request's pair (baseline_samples).
    The speculative results are stored as the sample requests' results (conditionally: nothing is stored
    twice; on_stored(status, stats) follows each one stored), so the sample is not decoded again.

    The sample is claimed for `worker` like any request (a live holder's requests are not sampled); the caller
    keeps the claims alive (run_job's LeaseKeeper, a worker's heartbeat). Returns None when the sample size is 0,
    the job already has a baseline, or nothing of the sample could be claimed.
    """
    worker = worker or new_token()
    if lease_seconds is None:
        lease_seconds = get_settings().lease_seconds
    with session_factory.begin() as s:
        job = queries.get_job(s, job_id)
        k = job.baseline_sample if sample_size is None else sample_size
        if k <= 0 or job.baseline_wall_s is not None:
            return None
        batch_size = job.batch_size
        sample = choose_sample(queries.valid_request_ids(s, job_id), k)
        claimed = queries.claim_requests(s, job_id, sample, worker=worker, lease_seconds=lease_seconds)
        rows = queries.request_inputs(s, claimed)
    prompts, params, ids = [], [], []
    for rid in claimed:
        r = rows[rid]
        try:
            prompts.append(build_prompt(decoder, r.endpoint, r.prompt))
            params.append(SamplingParams.from_dict(r.params))
        except Exception:  # noqa: BLE001  (the runner reports this request's error; the sample skips it)
            continue
        ids.append(rid)
    try:
        return _measure(session_factory, job_id, decoder, ids, prompts, params, batch_size, worker, on_stored)
    finally:  # whatever was claimed and not stored (a prompt the runner will fail, Ctrl-C): back to pending
        with session_factory.begin() as s:
            queries.release_requests(s, claimed, worker=worker)


def _measure(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    ids: list[int],
    prompts: list[Any],
    params: list[SamplingParams],
    batch_size: int,
    worker: str,
    on_stored: OnStored | None,
) -> Baseline | None:
    if not ids:
        return None
    base_decoder = decoder.without_speculation()
    # Untimed first, for both decoders: the sample's first WARMUP_TOKENS tokens at the job's batch size. First
    # calls pay one-time costs (a 2-token batch-1 warm-up met none of a batch-8 verify step's shapes), and a
    # job's speculative decoder starts with a cold draft policy (a plain step first, step costs and confidence
    # calibration unknown) that the rest of the job runs with once learned. `make demo` measured 0.90-1.02x
    # timed cold, 1.24-1.60x after this warm-up (its tokens per step: 2.7-2.8 either way).
    warm = [replace(p, max_new_tokens=min(p.max_new_tokens, WARMUP_TOKENS)) for p in params]
    for d in (decoder, base_decoder):
        d.generate(prompts, warm, batch_size=batch_size, return_errors=True)

    t0 = time.perf_counter()
    spec = decoder.generate(prompts, params, batch_size=batch_size, return_errors=True)
    sample_wall = time.perf_counter() - t0
    t0 = time.perf_counter()
    base = base_decoder.generate(prompts, params, batch_size=batch_size, return_errors=True)
    base_wall = time.perf_counter() - t0

    def tokens(results: list[Any]) -> int:
        return sum(r.stats.output_tokens for r in results if r.finish_reason != "error")

    b = Baseline(len(ids), tokens(base), base_wall, tokens(spec), sample_wall)
    with session_factory.begin() as s:
        first = queries.record_baseline(
            s, job_id,
            n_requests=b.n_requests,
            baseline_output_tokens=b.baseline_output_tokens,
            baseline_wall_s=b.baseline_wall_s,
            sample_output_tokens=b.sample_output_tokens,
            sample_wall_s=b.sample_wall_s,
        )
        if first:  # each request's pair, for reports (both decodes must have succeeded)
            record_baseline_samples(s, job_id, [
                SamplePair(rid, sr.stats.output_tokens, sr.stats.target_forwards, sr.stats.wall_s,
                           br.stats.output_tokens, br.stats.wall_s)
                for rid, sr, br in zip(ids, spec, base)
                if sr.finish_reason != "error" and br.finish_reason != "error"
            ])
    with session_factory.begin() as s:  # the results and the share of the decode time that produced them, at once
        stored = [res for rid, res in zip(ids, spec) if queries.save_result(s, rid, res, worker=worker)]
        b.stored = len(stored)
        queries.add_decode_time(s, job_id, sample_wall * b.stored / len(ids))
    if on_stored is not None:  # after the commit: only what SQL has
        for res in stored:
            on_stored(queries.result_status(res), res.stats)
    return b


# ---------------------------------------------------------------- running


def run_job(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    *,
    baseline: bool = True,
    should_stop: Callable[[], bool] | None = None,
    on_progress: Callable[[RunReport], None] | None = None,
    on_phase: Callable[[str, Any], None] | None = None,
    worker: str | None = None,
    lease_seconds: float | None = None,
) -> RunReport:
    """Local mode: the baseline (once per job), then every open request, then finalization (output file).
    Every claim is held by one token (`worker`, new when None) whose leases a LeaseKeeper renews meanwhile.

    on_phase(name, info): "baseline" (info: sample size) before it, "baseline_done" (info: Baseline | None),
    "run" (info: number of open requests) before the requests.
    """
    worker = worker or new_token()
    if lease_seconds is None:
        lease_seconds = get_settings().lease_seconds
    with session_factory.begin() as s:
        job = queries.get_job(s, job_id)
        status, k, has_baseline = job.status, job.baseline_sample, job.baseline_wall_s is not None
    if status == JOB_VALIDATING:
        raise JobStateError(
            f"job {job_id} was interrupted while its file was being validated: run the file again"
        )
    if status in (JOB_CANCELLING, JOB_CANCELLED, JOB_FAILED):
        raise JobStateError(f"job {job_id} is {status}; nothing to run")
    with LeaseKeeper(session_factory, worker, lease_seconds):
        if baseline and k > 0 and not has_baseline and status == JOB_IN_PROGRESS:
            if on_phase:
                on_phase("baseline", k)
            b = measure_baseline(session_factory, job_id, decoder, worker=worker, lease_seconds=lease_seconds)
            if on_phase:
                on_phase("baseline_done", b)
        if on_phase:
            with session_factory.begin() as s:
                on_phase("run", len(queries.open_request_ids(s, job_id)))
        return run_requests(
            session_factory, job_id, decoder, worker=worker, lease_seconds=lease_seconds, keep_alive=False,
            should_stop=should_stop, on_progress=on_progress,
        )


class JobBusyError(JobStateError):
    """Another live process holds some of the job's requests: they are left to it."""

    def __init__(self, job_id: str, holders: Sequence[Holder]):
        self.job_id = job_id
        self.holders = list(holders)
        super().__init__(
            f"job {job_id} is being run by another process: {'; '.join(map(str, holders))}. Nothing was taken "
            f"over: wait for it to finish, or run `spec-batch resume --wait {job_id}`, which continues once it "
            f"finishes or dies (a dead process on another machine lets go when its lease expires)"
        )


def wait_until_free(
    session_factory: sessionmaker[Session],
    job_id: str,
    *,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
) -> None:
    """Takes over the job's requests whose holder is gone (lease expired, or a dead process of this machine);
    when a live process holds some, raises JobBusyError, or with `wait` polls until none does."""
    while True:
        live = take_over_dead_holders(session_factory, job_id)
        if not live:
            return
        busy = JobBusyError(job_id, live)
        if not wait:
            raise busy
        if on_wait is not None:
            on_wait(busy)
        time.sleep(poll_s)


def resume_job(
    session_factory: sessionmaker[Session],
    job_id: str,
    decoder: Any,
    *,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
    **kwargs: Any,
) -> RunReport:
    """After Ctrl-C or a kill: requests a dead process left running go back to pending, then run_job. A live
    process's requests are never taken over (JobBusyError, or wait; see wait_until_free). A job killed while
    finalizing is finalized again (its output file rewritten)."""
    with session_factory() as s:
        job = queries.get_job(s, job_id)
        status, output_file = job.status, job.output_file
    if status == JOB_FINALIZING:
        if output_file:
            write_results(session_factory, job_id, output_file)
        with session_factory.begin() as s:
            finalized = queries.complete_job(s, job_id)
        return RunReport(job_id=job_id, finalized=finalized)
    if status not in JOB_TERMINAL:
        wait_until_free(session_factory, job_id, wait=wait, poll_s=poll_s, on_wait=on_wait)
    return run_job(session_factory, job_id, decoder, **kwargs)


@dataclass
class JobInfo:
    """What a caller needs to decide how to continue a job."""

    job_id: str
    status: str
    target: str
    drafter: str
    input_file: str | None
    output_file: str | None
    queue: str | None


def job_info(session_factory: sessionmaker[Session], job_id: str) -> JobInfo:
    with session_factory() as s:
        j = queries.get_job(s, job_id)
        return JobInfo(j.id, j.status, j.target, j.drafter, j.input_file, j.output_file, j.queue)


@dataclass
class ResumeOutcome:
    """What resume did: "completed" (nothing to do; a missing output file was written again), "enqueued"
    (a queued job went back to its workers: `enqueued` is the enqueue function's report; `running` chunks are
    left to the workers that hold them) or "ran" (decoded here: `report`)."""

    action: str
    info: JobInfo
    report: RunReport | None = None
    enqueued: Any = None
    running: int = 0


def resume(
    session_factory: sessionmaker[Session],
    job_id: str,
    *,
    decoder_for: Callable[[str, str], Any],
    enqueue: Callable[[sessionmaker[Session], str], Any] | None = None,
    wait: bool = False,
    poll_s: float = 2.0,
    on_wait: Callable[[JobBusyError], None] | None = None,
    **run_kwargs: Any,
) -> ResumeOutcome:
    """Continues a job the way it was started: a queued job goes back to its workers (`enqueue`, e.g.
    workers.enqueue.enqueue_job: the jobs layer never talks to the broker; chunks a live worker holds stay
    with it), a local one is decoded in this process with `decoder_for(target, drafter)` once no live process
    holds any of its requests (JobBusyError, or `wait`). A completed job only gets its output file back if it is
    missing. Raises JobStateError for a failed, cancelled or cancelling job."""
    info = job_info(session_factory, job_id)
    if info.status == JOB_COMPLETED:
        if info.output_file and not Path(info.output_file).exists():
            write_results(session_factory, job_id, info.output_file)
        return ResumeOutcome("completed", info)
    if info.status in (JOB_FAILED, JOB_CANCELLED, JOB_CANCELLING):
        raise JobStateError(f"job {job_id} is {info.status}; there is nothing to resume")
    if info.queue is not None:
        if enqueue is None:
            raise JobStateError(f"job {job_id} runs on the queue {info.queue}: resume it where the queue is reachable")
        enqueued = enqueue(session_factory, job_id)
        with session_factory() as s:
            running = len(qstore.running_chunk_holders(s, job_id))
        return ResumeOutcome("enqueued", info, enqueued=enqueued, running=running)
    if info.status != JOB_FINALIZING:  # before loading the model: a busy job is refused at once
        wait_until_free(session_factory, job_id, wait=wait, poll_s=poll_s, on_wait=on_wait)
    decoder = decoder_for(info.target, info.drafter)
    report = resume_job(session_factory, job_id, decoder, wait=wait, poll_s=poll_s, on_wait=on_wait, **run_kwargs)
    return ResumeOutcome("ran", info, report=report)


# ---------------------------------------------------------------- cancel


@dataclass
class CancelOutcome:
    job_id: str
    status: str  # the job's status afterwards: cancelling (requests still running) or cancelled
    running: int  # requests still running (they stop at their next decoding step)


def cancel_job(session_factory: sessionmaker[Session], job_id: str) -> CancelOutcome:
    """validating/in_progress -> cancelling: queued chunks are dropped, pending requests are cancelled, and the
    job is cancelled as soon as nothing runs. Cancelling a cancelled job again is a no-op; any other status
    raises JobStateError."""
    with session_factory.begin() as s:
        status = queries.get_job(s, job_id).status
        changed = queries.request_cancel(s, job_id)
        if changed:
            qstore.cancel_queued_chunks(s, job_id)
    if not changed and status not in (JOB_CANCELLING, JOB_CANCELLED):
        raise JobStateError(f"job {job_id} is {status}; it cannot be cancelled")
    with session_factory.begin() as s:
        queries.try_finish_cancel(s, job_id)
        status = queries.get_job(s, job_id).status
        running = queries.job_counts(s, job_id)[REQ_RUNNING]
    return CancelOutcome(job_id, status, running)
