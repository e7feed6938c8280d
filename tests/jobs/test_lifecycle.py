"""The job lifecycle's transition table (spec_batch.jobs.lifecycle): every allowed change happens exactly once in
SQL, every refused one leaves the row as it was, and resume's meaning per status."""

from __future__ import annotations

import itertools
import os

import pytest

from spec_batch.jobs import lifecycle
from spec_batch.jobs.lifecycle import JobStateError
from spec_batch.store import JOB_STATUSES, Job, Request, make_session_factory, queries

ALLOWED = {
    ("validating", "in_progress"),
    ("validating", "failed"),
    ("validating", "cancelling"),
    ("in_progress", "finalizing"),
    ("in_progress", "failed"),
    ("in_progress", "cancelling"),
    ("finalizing", "completed"),
    ("finalizing", "failed"),
    ("cancelling", "cancelled"),
    ("in_progress", "expired"),
}


def test_the_table_is_the_documented_diagram():
    pairs = {(a, b) for a, targets in lifecycle.TRANSITIONS.items() for b in targets}
    assert pairs == ALLOWED
    assert set(lifecycle.TRANSITIONS) == set(JOB_STATUSES)
    assert {s for s in JOB_STATUSES if lifecycle.is_terminal(s)} == {"completed", "failed", "cancelled", "expired"}
    for a, b in itertools.product(JOB_STATUSES, repeat=2):
        assert lifecycle.can_change(a, b) == ((a, b) in ALLOWED)
    assert lifecycle.sources_of("failed") == ("validating", "in_progress", "finalizing")
    assert lifecycle.sources_of("validating") == ()  # nothing goes back to the start


def _job(factory, status: str, *, requests: tuple[str, ...] = ()) -> str:
    job_id = "job_" + os.urandom(8).hex()
    with factory.begin() as s:
        s.add(
            Job(
                id=job_id,
                target="t",
                drafter="ngram",
                sampling_defaults={},
                n_requests=len(requests),
                baseline_sample=0,
                status=status,
            )
        )
        for i, st in enumerate(requests):
            s.add(
                Request(
                    job_id=job_id,
                    custom_id=f"c{i}",
                    line_number=i + 1,
                    input="{}",
                    status=st,
                    endpoint="/v1/completions",
                    prompt="p",
                    params={"max_new_tokens": 4},
                )
            )
    return job_id


CHANGES = {  # target status -> the lifecycle function that goes there
    "in_progress": lambda s, j: lifecycle.start(s, j),
    "failed": lambda s, j: lifecycle.fail(s, j, "broken"),
    "finalizing": lambda s, j: lifecycle.begin_finalizing(s, j),
    "completed": lambda s, j: lifecycle.complete(s, j),
    "cancelling": lambda s, j: lifecycle.request_cancel(s, j),
    "cancelled": lambda s, j: lifecycle.settle_cancel(s, j),
}


@pytest.mark.parametrize("target", sorted(CHANGES))
def test_each_change_from_every_status_in_sql(db_url, target):
    """Each change succeeds from exactly its allowed sources (stamping its timestamp), once, and is refused
    from every other status without touching the row."""
    factory = make_session_factory(db_url)
    for source in JOB_STATUSES:
        job_id = _job(factory, source)
        with factory.begin() as s:
            changed = CHANGES[target](s, job_id)
        with factory() as s:
            job = queries.get_job(s, job_id)
            assert changed == ((source, target) in ALLOWED), (source, target)
            assert job.status == (target if changed else source)
            stamp = lifecycle.ENTERED_AT.get(target)
            if stamp is not None:
                assert (getattr(job, stamp) is not None) == changed
        if changed:  # a second, racing caller changes nothing
            with factory.begin() as s:
                assert CHANGES[target](s, job_id) is False


def test_fail_validating_only_from_validating(db_url):
    """A file that failed validation fails its job only while it is validating: a job cancelled meanwhile, or
    started by another process validating it too, is left as it is."""
    factory = make_session_factory(db_url)
    for source in JOB_STATUSES:
        job_id = _job(factory, source)
        with factory.begin() as s:
            assert lifecycle.fail_validating(s, job_id, "bad line") == (source == "validating"), source
        with factory() as s:
            job = queries.get_job(s, job_id)
            assert job.status == ("failed" if source == "validating" else source)
    assert [s for s in JOB_STATUSES if lifecycle.is_validating(s)] == ["validating"]


def test_conditions_on_requests(db_url):
    factory = make_session_factory(db_url)
    busy = _job(factory, "in_progress", requests=("completed", "pending"))
    with factory.begin() as s:
        assert lifecycle.begin_finalizing(s, busy) is False  # a request is open
    cancelling = _job(factory, "cancelling", requests=("running", "pending"))
    with factory.begin() as s:
        assert lifecycle.settle_cancel(s, cancelling) is False  # one still runs...
    with factory() as s:
        assert queries.job_counts(s, cancelling)["cancelled"] == 1  # ...but the pending one is cancelled


def test_finalize_job_writes_then_completes(db_url, tmp_path):
    factory = make_session_factory(db_url)
    job_id = _job(factory, "in_progress", requests=("completed",))
    with factory.begin() as s:
        s.get(Job, job_id).output_file = str(tmp_path / "out.jsonl")
    assert lifecycle.finalize_job(factory, job_id) is True
    assert lifecycle.finalize_job(factory, job_id) is False
    assert (tmp_path / "out.jsonl").exists()
    with factory() as s:
        assert queries.get_job(s, job_id).status == "completed"


def test_resume_and_run_rules():
    assert lifecycle.resume_action("j", "in_progress") == lifecycle.RESUME_RUN
    assert lifecycle.resume_action("j", "validating") == lifecycle.RESUME_RUN
    assert lifecycle.resume_action("j", "finalizing") == lifecycle.RESUME_FINISH_FINALIZING
    assert lifecycle.resume_action("j", "completed") == lifecycle.RESUME_REWRITE_OUTPUT
    for status in ("failed", "cancelled", "cancelling"):
        with pytest.raises(JobStateError, match=f"is {status}"):
            lifecycle.resume_action("j", status)
    for status in ("validating", "failed", "cancelling", "cancelled"):
        with pytest.raises(JobStateError):
            lifecycle.check_runnable("j", status)
    lifecycle.check_runnable("j", "in_progress")
    assert [s for s in JOB_STATUSES if lifecycle.takes_new_work(s)] == ["validating", "in_progress", "finalizing"]


def _status(factory, job_id: str) -> str:
    with factory() as s:
        return queries.get_job(s, job_id).status


def test_after_run_decides_what_the_job_does(db_url):
    """Callers report how a run ended; lifecycle settles, completes or fails the job, or leaves it."""
    factory = make_session_factory(db_url)
    FINISHED, INTERRUPTED = lifecycle.RunOutcome.FINISHED, lifecycle.RunOutcome.INTERRUPTED
    done = _job(factory, "in_progress", requests=("completed", "failed"))
    assert lifecycle.after_run(factory, done, FINISHED, finalize=False) == lifecycle.Settled()
    assert _status(factory, done) == "in_progress"  # a partial run's caller completes nothing
    assert lifecycle.after_run(factory, done, INTERRUPTED) == lifecycle.Settled()  # a stop completes nothing
    assert lifecycle.after_run(factory, done, FINISHED) == lifecycle.Settled(completed=True)
    assert lifecycle.after_run(factory, done, FINISHED) == lifecycle.Settled()  # once
    assert _status(factory, done) == "completed"

    still_open = _job(factory, "in_progress", requests=("completed", "pending"))
    assert not lifecycle.after_run(factory, still_open, FINISHED).ended  # another run has work left
    assert _status(factory, still_open) == "in_progress"

    # a job cancelled while the run went on settles whatever the run saw, once nothing of it runs
    cancelling = _job(factory, "cancelling", requests=("completed", "pending"))
    assert lifecycle.after_run(factory, cancelling, FINISHED) == lifecycle.Settled(cancelled=True)
    assert _status(factory, cancelling) == "cancelled"
    busy = _job(factory, "cancelling", requests=("running", "pending"))
    assert not lifecycle.after_run(factory, busy, INTERRUPTED).ended
    assert _status(factory, busy) == "cancelling"

    broken = _job(factory, "in_progress", requests=("pending",))
    settled = lifecycle.after_run(factory, broken, lifecycle.RunOutcome.BROKEN, error="no model")
    assert settled == lifecycle.Settled(failed=True)
    with factory() as s:
        job = queries.get_job(s, broken)
        assert (job.status, job.error) == ("failed", "no model")


def test_an_expired_job_keeps_what_was_done_and_settles_what_its_runner_hands_back(db_url):
    factory = make_session_factory(db_url)
    job_id = _job(factory, "in_progress", requests=("completed", "running", "pending"))
    with factory.begin() as s:
        assert lifecycle.expire(s, job_id)
        assert not lifecycle.expire(s, job_id)  # once
    with factory() as s:
        job = queries.get_job(s, job_id)
        assert (job.status, job.expired_at is not None) == ("expired", True)
        assert queries.job_counts(s, job_id) == {
            "pending": 0,
            "running": 1,
            "completed": 1,
            "failed": 0,
            "cancelled": 1,
        }
    assert lifecycle.is_stopping("expired") and not lifecycle.takes_new_work("expired")
    with factory.begin() as s:  # its runner stops and hands the running request back
        s.execute(
            Request.__table__.update()
            .where(Request.job_id == job_id, Request.status == "running")
            .values(status="pending")
        )
    assert lifecycle.after_run(factory, job_id, lifecycle.RunOutcome.CANCELLED) == lifecycle.Settled()
    with factory() as s:
        assert queries.job_counts(s, job_id)["cancelled"] == 2
        codes = {r.error_code for r in queries.get_job(s, job_id).requests if r.status == "cancelled"}
        assert codes == {"batch_expired"} and _status(factory, job_id) == "expired"
    with pytest.raises(JobStateError):
        lifecycle.resume_action(job_id, "expired")


def test_wants_baseline_once_while_running(db_url):
    factory = make_session_factory(db_url)
    job_id = _job(factory, "in_progress", requests=("pending", "pending"))
    with factory.begin() as s:
        job = s.get(Job, job_id)
        assert not lifecycle.wants_baseline(job)  # no sample asked for
        job.baseline_sample = 2
        assert lifecycle.wants_baseline(job)
        job.n_invalid = 2
        assert not lifecycle.wants_baseline(job)  # no valid request to sample
        job.n_invalid = 0
        job.baseline_wall_s = 1.0
        assert not lifecycle.wants_baseline(job)  # measured already: the first measurement wins
    for status in ("validating", "finalizing", "cancelling", "completed"):
        with factory.begin() as s:
            job = s.get(Job, _job(factory, status, requests=("pending",)))
            job.baseline_sample = 1
            assert not lifecycle.wants_baseline(job), status
