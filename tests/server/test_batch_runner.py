"""The local batch runner in process, over the fake decoder (the Decoder interface without a model): it runs the
batches it finds, hands its requests back when stopped, and a new runner finishes them (nothing done twice)."""

from __future__ import annotations

import dataclasses
import io
import json
import time

import pytest

from spec_batch.server.batch_create import create_batch
from spec_batch.server.batch_runner import LocalBatchRunner, QueueBatchRunner, make_batch_runner
from spec_batch.server.context import ServerContext
from spec_batch.server.file_io import store_upload
from spec_batch.server.served import ServedModel
from spec_batch.settings import get_settings
from spec_batch.store import make_session_factory, queries


@pytest.fixture
def ctx_of(db_url):
    factory = make_session_factory(db_url)

    def make(decoder, runner: str = "local") -> ServerContext:
        settings = dataclasses.replace(get_settings(), database_url=db_url, api_runner=runner)
        return ServerContext(settings, factory, ServedModel("fake", "fake", "ngram"), decoder=decoder)

    yield make
    factory.kw["bind"].dispose()


def _file(ctx: ServerContext, n: int) -> str:
    lines = [
        json.dumps({"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": f"p{i}", "max_tokens": 12}})
        for i in range(n)
    ]
    return store_upload(
        ctx.session_factory,
        io.BytesIO("\n".join(lines).encode()),
        owner=None,
        filename="f.jsonl",
        purpose="batch",
        max_bytes=1 << 20,
        max_lines=100,
    )


def _batch(ctx: ServerContext, runner, n: int) -> str:
    file_id = _file(ctx, n)
    batch_id = create_batch(
        ctx.session_factory,
        input_file_id=file_id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        owner=None,
        fields=runner.job_fields(),
        max_line_bytes=1 << 20,
        max_lines=100,
    )
    runner.submitted(batch_id)
    return batch_id


def _state(ctx: ServerContext, batch_id: str) -> tuple[str, dict[str, int]]:
    with ctx.session_factory() as s:
        return queries.get_job(s, batch_id).status, queries.job_counts(s, batch_id)


def _wait(cond, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_make_batch_runner_follows_the_setting_and_registers_itself(ctx_of, fake_decoder_cls):
    for name, cls in (("local", LocalBatchRunner), ("queue", QueueBatchRunner)):
        ctx = ctx_of(fake_decoder_cls(), name)
        runner = make_batch_runner(ctx)
        assert isinstance(runner, cls) and ctx.batches is runner
    assert QueueBatchRunner(ctx).job_fields().queue == "spec-batch.fake.ngram"


def test_a_stopped_runner_hands_back_and_the_next_one_finishes(ctx_of, fake_decoder_cls):
    slow = fake_decoder_cls(step_delay=0.02)
    ctx = ctx_of(slow)
    runner = make_batch_runner(ctx)
    runner.start()
    batch_id = _batch(ctx, runner, 30)
    _wait(lambda: _state(ctx, batch_id)[1]["completed"] >= 1)
    runner.stop()
    status, counts = _state(ctx, batch_id)
    assert status == "in_progress" and counts["running"] == 0 and counts["pending"] > 0

    again = make_batch_runner(ctx_of(fake_decoder_cls()))
    again.start()
    try:
        _wait(lambda: _state(ctx, batch_id)[0] == "completed")
    finally:
        again.stop()
    assert _state(ctx, batch_id)[1]["completed"] == 30


def test_stop_and_cancel_do_not_wait_for_the_baseline_sample(ctx_of, fake_decoder_cls):
    """The baseline takes no should_stop: the runner checks before each of its decodes (each a slice of the
    sample), so a stop or a cancel waits for one decode at most, not the whole measurement."""
    slow = fake_decoder_cls(step_delay=0.05)
    ctx = ctx_of(slow)
    runner = make_batch_runner(ctx)
    runner.start()
    batch_id = _batch(ctx, runner, 30)
    _wait(lambda: slow.steps_run > 0)
    t0 = time.monotonic()
    runner.stop()
    assert time.monotonic() - t0 < 10
    status, counts = _state(ctx, batch_id)
    assert status == "in_progress" and counts["running"] == 0 and counts["completed"] == 0
    with ctx.session_factory() as s:
        assert queries.get_job(s, batch_id).baseline_wall_s is None
        assert {r.attempts for r in queries.iter_requests(s, batch_id)} == {0}  # a clean stop counts no attempt

    runner = make_batch_runner(ctx)
    runner.start()
    try:
        steps = slow.steps_run
        _wait(lambda: slow.steps_run > steps)
        from spec_batch.jobs.service import cancel_job

        cancel_job(ctx.session_factory, batch_id)
        _wait(lambda: _state(ctx, batch_id)[0] == "cancelled", timeout=10)
    finally:
        runner.stop()
    assert _state(ctx, batch_id)[1]["cancelled"] == 30


@pytest.mark.redis
def test_the_queue_runner_enqueues_a_batch_and_adopts_orphans_when_it_starts(ctx_of, fake_decoder_cls, tmp_path):
    """submitted() publishes the batch's chunks; a batch stored by a server that died before enqueueing it gets
    its chunks when the next server starts (stop leaves everything with the queue)."""
    import shutil

    import redis

    from bench.processes import RedisServer
    from spec_batch.store import chunks

    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed")
    broker = RedisServer(tmp_path / "redis").start()
    try:
        ctx = ctx_of(fake_decoder_cls(), "queue")
        ctx.settings = dataclasses.replace(ctx.settings, broker_url=broker.url, chunk_size=4)
        runner = make_batch_runner(ctx)
        enqueued = _batch(ctx, runner, 6)
        orphan = create_batch(
            ctx.session_factory,
            input_file_id=_file(ctx, 5),
            endpoint="/v1/completions",
            completion_window="24h",
            metadata=None,
            owner=None,
            fields=runner.job_fields(),
            max_line_bytes=1 << 20,
            max_lines=100,
        )  # stored, never submitted: a server died
        with ctx.session_factory() as s:
            assert len(chunks.job_chunks(s, enqueued)) == 2 and chunks.job_chunks(s, orphan) == []
        runner.start()
        runner.stop()
        with ctx.session_factory() as s:
            assert len(chunks.job_chunks(s, orphan)) == 2
            assert queries.get_job(s, orphan).queue == "spec-batch.fake.ngram"
        assert redis.Redis.from_url(broker.url).llen("spec-batch.fake.ngram") == 4
    finally:
        broker.stop()


def test_the_runners_stop_is_a_run_stopped_not_a_ctrl_c():
    from spec_batch.jobs.claims import CLEAN_INTERRUPTIONS
    from spec_batch.jobs.errors import RunStopped
    from spec_batch.server.batch_runner import BatchStopped

    assert issubclass(BatchStopped, RunStopped) and not issubclass(BatchStopped, KeyboardInterrupt)
    assert issubclass(BatchStopped, CLEAN_INTERRUPTIONS)


def test_every_decoder_jobs_and_the_server_take_is_decoder_like(fake_decoder, tiny_decoder):
    from spec_batch.core.decoder_like import DecoderLike
    from spec_batch.core.engine import Engine
    from spec_batch.server.batch_runner import _Stoppable

    decoder = tiny_decoder("ngram")
    engine_decoder = Engine(decoder).as_decoder()  # not started: only its shape is checked
    for d in (fake_decoder, _Stoppable(fake_decoder, lambda: False), decoder, engine_decoder):
        assert isinstance(d, DecoderLike) and isinstance(d.without_speculation(), DecoderLike)
