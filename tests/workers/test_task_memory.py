"""A worker keeps a job's memory across the chunks it runs (warmed from SQL on first use: the job's outputs
done so far, by anyone), and drops it when the job ends."""

from __future__ import annotations

from spec_batch.jobs import lease
from spec_batch.workers import tasks


def test_a_job_memory_lives_across_chunks_and_goes_with_the_job(factory, queued_job, fake_runtime, fake_decoder_cls):
    job_id, chunks = queued_job(n=6, chunk_size=2)
    decoder = fake_decoder_cls(draft_name="suffix")
    decoder.tokenizer.encode = lambda text, **kw: [ord(c) for c in text]  # the fake's tokens are characters
    rt = fake_runtime(decoder)
    tasks._process(rt, chunks[0].id, lease.new_token())
    first = decoder.memories[-1]
    assert len(first) == 0 and job_id in rt.memories  # nothing was done before the first chunk
    rt.memories.drop(job_id)  # as if this worker had not run the first chunk: it warms from SQL
    tasks._process(rt, chunks[1].id, lease.new_token())
    second = decoder.memories[-1]
    assert second is not first and len(second) == 2  # the first chunk's outputs
    out = tasks._process(rt, chunks[2].id, lease.new_token())
    assert decoder.memories[-1] is second  # the same memory for the job's next chunk
    assert out["finalized"] and job_id not in rt.memories  # the job ended: its memory is gone


def test_no_memory_for_drafters_without_one(factory, queued_job, fake_runtime, fake_decoder_cls):
    _job_id, chunks = queued_job(n=2, chunk_size=2)
    decoder = fake_decoder_cls()
    tasks._process(fake_runtime(decoder), chunks[0].id, lease.new_token())
    assert decoder.memories == [None]
