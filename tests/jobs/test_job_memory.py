"""Job memories: the store's recent outputs, warming, a worker's LRU of jobs, and the runner giving a suffix
decoder one memory for the whole job. A memory changes drafts, never outputs."""

from __future__ import annotations

from datetime import timedelta

from batch_lines import completion_line, write_batch
from sqlalchemy import select, update

from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.jobs import create_job_from_file
from spec_batch.jobs.job_memory_store import JobMemories, uses_job_memory, warm_memory
from spec_batch.jobs.runner import run_requests
from spec_batch.store import Request, make_session_factory, queries
from spec_batch.store.models import utcnow

PROMPTS = ["1 2 3 4 5 1 2 3", "7 8 9", "5 5 5 5 5 1", "3", "10 20 30 10 20 30 10", "1 2 3 4 5 6"]
N_NEW = 12


def _job(factory, tmp_path, name: str, drafter: str = "suffix") -> str:
    lines = [completion_line(f"c{i}", p, max_tokens=N_NEW, temperature=0) for i, p in enumerate(PROMPTS)]
    path = write_batch(tmp_path / f"{name}.jsonl", lines)
    job_id, _ = create_job_from_file(
        factory,
        path,
        target="tiny",
        drafter=drafter,
        batch_size=2,
        baseline_sample=0,
        output_file=tmp_path / f"{name}.out.jsonl",
    )
    return job_id


def _outputs(factory, job_id) -> list[str | None]:
    with factory() as s:
        return list(s.scalars(select(Request.output).where(Request.job_id == job_id).order_by(Request.line_number)))


def _ids(factory, job_id) -> list[int]:
    with factory() as s:
        return list(s.scalars(select(Request.id).where(Request.job_id == job_id).order_by(Request.line_number)))


def test_recent_outputs_newest_first_up_to_a_token_budget(db_url, tmp_path):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, "j")
    ids = _ids(factory, job_id)
    now = utcnow()
    with factory.begin() as s:
        for i, rid in enumerate(ids[:4]):  # completed in line order, one minute apart; the rest stay pending
            s.execute(
                update(Request)
                .where(Request.id == rid)
                .values(status="completed", output=f"out{i}", output_tokens=10, completed_at=now + timedelta(minutes=i))
            )
    with factory() as s:
        assert queries.recent_outputs(s, job_id, 25) == ["out3", "out2", "out1"]  # the one crossing 25 included
        assert queries.recent_outputs(s, job_id, 10) == ["out3"]
        assert queries.recent_outputs(s, job_id, 1000) == ["out3", "out2", "out1", "out0"]
        assert queries.recent_outputs(s, "no-such-job", 1000) == []


def test_a_job_through_the_runner_with_memory_has_the_same_outputs_as_without(db_url, tmp_path, tiny_decoder):
    factory = make_session_factory(db_url)
    plain, remembering = _job(factory, tmp_path, "plain", "none"), _job(factory, tmp_path, "suffix")
    run_requests(factory, plain, tiny_decoder("none"))
    memory = JobMemory(max_tokens=10_000)
    suffix = tiny_decoder("suffix")
    assert uses_job_memory(suffix) and not uses_job_memory(tiny_decoder("ngram"))
    report = run_requests(factory, remembering, suffix, memory=memory)
    assert report.completed == len(PROMPTS)
    assert _outputs(factory, remembering) == _outputs(factory, plain)
    assert len(memory) == len(PROMPTS) and memory.num_tokens >= len(PROMPTS) * N_NEW


def test_warming_reads_the_completed_outputs_and_a_resume_gets_them(db_url, tmp_path, tiny_decoder, fake_tokenizer):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, "j")
    ids = _ids(factory, job_id)
    suffix = tiny_decoder("suffix")
    run_requests(factory, job_id, suffix, request_ids=ids[:3], finalize=False)  # a first chunk
    done = [o for o in _outputs(factory, job_id) if o is not None]
    memory = warm_memory(factory, job_id, fake_tokenizer, max_tokens=10_000)
    assert len(memory) == 3 and memory.num_tokens == sum(len(fake_tokenizer.encode(o)) for o in done)
    first = fake_tokenizer.encode(done[0])
    assert memory.index.count(first[:4]) >= 1
    small = warm_memory(factory, job_id, fake_tokenizer, max_tokens=1)  # the most recent output only
    assert len(small) == 1


def test_a_worker_keeps_a_few_jobs_memories_and_drops_ended_jobs(db_url, tmp_path, tiny_decoder, fake_tokenizer):
    factory = make_session_factory(db_url)
    jobs = [_job(factory, tmp_path, f"j{i}") for i in range(3)]
    run_requests(factory, jobs[0], tiny_decoder("suffix"), request_ids=_ids(factory, jobs[0])[:2], finalize=False)
    memories = JobMemories(max_jobs=2, max_tokens=10_000)
    first = memories.get(factory, jobs[0], fake_tokenizer)
    assert len(first) == 2  # warmed from SQL
    assert memories.get(factory, jobs[0], fake_tokenizer) is first  # kept across chunks
    memories.get(factory, jobs[1], fake_tokenizer)
    memories.get(factory, jobs[0], fake_tokenizer)  # used: jobs[1] is now the least recent
    memories.get(factory, jobs[2], fake_tokenizer)
    assert jobs[0] in memories and jobs[1] not in memories and jobs[2] in memories
    memories.drop(jobs[0])
    assert jobs[0] not in memories


def test_the_runner_warms_a_memory_for_suffix_decoders_only(db_url, tmp_path, fake_decoder_cls):
    factory = make_session_factory(db_url)
    job_id = _job(factory, tmp_path, "j")
    ngram = fake_decoder_cls()
    run_requests(factory, job_id, ngram, request_ids=_ids(factory, job_id)[:2], finalize=False)
    assert ngram.memories == [None]
    suffix = fake_decoder_cls(draft_name="suffix")
    suffix.tokenizer.encode = lambda text, **kw: [ord(c) for c in text]  # the fake's tokens are characters
    run_requests(factory, job_id, suffix, finalize=False)
    memory = suffix.memories[0]
    assert isinstance(memory, JobMemory) and len(memory) == 2  # the first two outputs, from SQL
    assert memory.num_tokens == 2 * N_NEW  # the fake answers N_NEW characters of its reply
