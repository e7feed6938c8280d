"""Submitting jobs to the queue and re-enqueueing them (``spec-batch submit``, ``spec-batch resume`` of a queue job).

Order of operations (docs/architecture.md: enqueue only after the job rows are committed):

1. the broker is checked first: Redis down -> :class:`BrokerUnavailableError` and no job is created;
2. the file is validated and the job and its requests are stored (``spec_batch.jobs.create_job_from_file``),
   then its chunks (``queue_chunks``), each commit done before anything is published;
3. each chunk is published (task id = chunk id) to the job's queue, then marked published in the broker's
   epoch. If Redis goes away in the middle: when nothing was published yet the job is deleted again (no
   half-created job); otherwise the rest is published by the workers' reaper as soon as Redis is back (within
   one lease), or at once by :func:`enqueue_job` (``spec-batch resume JOB``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from sqlalchemy.orm import Session, sessionmaker

from spec_batch.errors import SpecBatchError
from spec_batch.jobs import create_job_from_file, lifecycle
from spec_batch.settings import get_settings, shown_url
from spec_batch.store import chunks, queries

from .publish import publish_chunk
from .reaper import broker_epoch
from .routing import check_queue_name, queue_name

log = logging.getLogger("spec_batch.workers.enqueue")


class BrokerUnavailableError(SpecBatchError):
    """The broker (Redis) cannot be reached."""


class PartialEnqueueError(SpecBatchError):
    """The job is stored but some of its chunks could not be published yet."""

    def __init__(self, message: str, job_id: str, published: int, total: int):
        super().__init__(message)
        self.job_id = job_id
        self.published = published
        self.total = total


def check_broker(broker_url: str | None = None) -> str:
    """The broker's epoch; a clear error when it cannot be reached."""
    broker_url = broker_url or get_settings().broker_url
    try:
        return broker_epoch(broker_url)
    except Exception as exc:
        raise BrokerUnavailableError(
            f"cannot reach the broker at {shown_url(broker_url)} ({exc.__class__.__name__}: {exc}); start Redis "
            f"or point SPEC_BATCH_BROKER_URL at it"
        ) from exc


@dataclass
class SubmitResult:
    job_id: str
    status: str
    queue: str | None
    n_requests: int
    n_invalid: int
    n_chunks: int = 0
    published: int = 0
    parse_report: Any = None
    errors: list[str] = field(default_factory=list)


def _publish(
    to_publish: list[tuple[str, str]], session_factory: sessionmaker[Session], epoch: str, broker_url: str | None = None
) -> tuple[int, Exception | None]:
    done: list[str] = []
    error: Exception | None = None
    for chunk_id, queue in to_publish:
        try:
            publish_chunk(chunk_id, queue, broker_url=broker_url)
        except Exception as exc:
            error = exc
            break
        done.append(chunk_id)
    if done:
        for i in range(0, len(done), 500):
            with session_factory.begin() as s:
                chunks.mark_published(s, done[i : i + 500], epoch)
    return len(done), error


def submit_file(
    session_factory: sessionmaker[Session],
    path: str | Path,
    *,
    target: str,
    drafter: str,
    batch_size: int = 8,
    baseline_sample: int = 8,
    chunk_size: int | None = None,
    sampling_defaults: dict[str, Any] | None = None,
    metadata: dict[str, Any] | None = None,
    queue: str | None = None,
    broker_url: str | None = None,
    weights: str | None = None,
    dtype: str | None = None,
) -> SubmitResult:
    """Validates and stores the job, then publishes its chunks. See the module docstring. weights / dtype: the
    job's precision (None: full weights at the worker device's default dtype); part of the queue's name."""
    settings = get_settings()
    chunk_size = chunk_size or settings.chunk_size
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    queue = check_queue_name(queue) if queue is not None else queue_name(target, drafter, weights, dtype)
    broker_url = broker_url or settings.broker_url
    epoch = check_broker(broker_url)

    job_id, report = create_job_from_file(
        session_factory,
        path,
        target=target,
        drafter=drafter,
        batch_size=batch_size,
        baseline_sample=baseline_sample,
        sampling_defaults=sampling_defaults,
        metadata=metadata,
        queue=queue,
        chunk_size=chunk_size,
        weights=weights,
        dtype=dtype,
    )
    with session_factory.begin() as s:
        job = queries.get_job(s, job_id)
        result = SubmitResult(job_id, job.status, queue, job.n_requests, job.n_invalid, parse_report=report)
        if not lifecycle.is_running(job.status):
            return result  # no valid line: the job failed; nothing to enqueue
        ids = queries.open_request_ids(s, job_id)
        new = chunks.add_chunks(s, job_id, queue, ids, chunk_size, measure_baseline=lifecycle.wants_baseline(job))
        pending = [(c.id, c.queue) for c in new]
    result.n_chunks = len(pending)
    result.published, error = _publish(pending, session_factory, epoch, broker_url)
    if error is not None:
        _publish_failed(session_factory, job_id, result.published, len(pending), error)
    return result


def _publish_failed(
    session_factory: sessionmaker[Session], job_id: str, published: int, total: int, error: Exception
) -> NoReturn:
    """A submit whose broker failed midway: with nothing published the job is deleted again (no half-created
    job); otherwise it stays, and the reaper or `spec-batch resume` publishes the rest."""
    if published == 0 and _delete_unpublished_job(session_factory, job_id):
        raise BrokerUnavailableError(
            f"the broker went away while enqueueing ({error.__class__.__name__}: {error}); "
            f"no job was created: submit the file again once Redis is back"
        ) from error
    raise PartialEnqueueError(
        f"job {job_id} is stored but only {published} of {total} chunks could be enqueued "
        f"({error.__class__.__name__}: {error}). The workers publish the rest once Redis is back (within "
        f"SPEC_BATCH_LEASE_SECONDS), or run `spec-batch resume {job_id}` then.",
        job_id,
        published,
        total,
    ) from error


def _delete_unpublished_job(session_factory: sessionmaker[Session], job_id: str) -> bool:
    """Deletes a job none of whose chunks was ever published or started."""
    try:
        with session_factory.begin() as s:
            return chunks.delete_unpublished_job(s, job_id)
    except Exception as exc:  # pragma: no cover - the database went away too
        log.warning("could not delete the unpublished job %s: %s", job_id, exc)
        return False


@dataclass
class EnqueueReport:
    job_id: str
    status: str
    new_chunks: int = 0
    republished: int = 0


def enqueue_job(
    session_factory: sessionmaker[Session],
    job_id: str,
    *,
    chunk_size: int | None = None,
    broker_url: str | None = None,
    republish_queued: bool = True,
) -> EnqueueReport:
    """(Re-)enqueues a queue job: open requests no live chunk covers get new chunks, and (by default) every
    queued chunk is published again (a duplicate message is harmless: the task skips a chunk it cannot
    claim). A job left ``validating`` with open requests starts (``in_progress``); a job that is not running
    afterwards (it ended, is being cancelled, or changed status meanwhile) gets nothing new, and the report says
    the status it has. Running chunks are left to their leases."""
    settings = get_settings()
    broker_url = broker_url or settings.broker_url
    epoch = check_broker(broker_url)
    with session_factory.begin() as s:
        job = queries.get_job(s, job_id)
        if lifecycle.is_terminal(job.status):
            return EnqueueReport(job_id, job.status)
        queue = job.queue or queue_name(job.target, job.drafter, job.weights, job.dtype)
        size = chunk_size or job.chunk_size or settings.chunk_size
        chunks.set_job_queue(s, job_id, queue, size)
        if queries.open_request_ids(s, job_id):
            lifecycle.start(s, job_id)  # a job left validating starts
        s.refresh(job)  # start is conditional: the status as it is now, whoever changed it, not as assumed
        status = job.status
        if not lifecycle.is_running(status):
            return EnqueueReport(job_id, status)
        needs_baseline = lifecycle.wants_baseline(job) and not chunks.baseline_chunk_pending(s, job_id)
        new = chunks.add_chunks(
            s, job_id, queue, chunks.orphan_request_ids(s, job_id), size, measure_baseline=needs_baseline
        )
        new_ids = {c.id for c in new}
        todo = [
            (c.id, c.queue)
            for c in chunks.job_chunks(s, job_id, [chunks.CHUNK_QUEUED])
            if republish_queued or c.id in new_ids
        ]
    published, error = _publish(todo, session_factory, epoch, broker_url)
    if error is not None:
        raise BrokerUnavailableError(
            f"job {job_id}: {published} of {len(todo)} chunks published before the broker failed "
            f"({error.__class__.__name__}: {error}); the workers publish the rest once Redis is back"
        ) from error
    return EnqueueReport(job_id, status, new_chunks=len(new), republished=published - len(new))


__all__ = [
    "BrokerUnavailableError",
    "EnqueueReport",
    "PartialEnqueueError",
    "SubmitResult",
    "check_broker",
    "enqueue_job",
    "submit_file",
]
