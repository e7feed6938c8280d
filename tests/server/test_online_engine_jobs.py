"""A bulk job decoded through the server's engine (`engine.as_decoder()`, what `ctx.decoder` holds) while
an online stream shares its steps: the job's stored outputs equal those of the same job through a plain Decoder
(the runner's on_result, return_errors, should_stop and the baseline's without_speculation all work on it)."""

from __future__ import annotations

from batch_lines import completion_line, write_batch
from sqlalchemy import select

from spec_batch import SamplingParams
from spec_batch.core.engine import Engine
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.store import Request, make_session_factory

PROMPTS = ["1 2 3 4 5 1 2 3", "7 8 9", "5 5 5 5 5 5 1", "3", "10 20 30 10 20 30 10"]


def _job(factory, tmp_path, name: str) -> str:
    lines = [completion_line(f"r{i}", p, max_tokens=12) for i, p in enumerate(PROMPTS)]
    lines.append(completion_line("long", "1 2", max_tokens=10**6))  # fails alone: longer than the context
    path = write_batch(tmp_path / f"{name}.jsonl", lines)
    job_id, _ = create_job_from_file(
        factory,
        path,
        target="tiny",
        drafter="ngram",
        batch_size=2,
        baseline_sample=2,
        output_file=tmp_path / f"{name}.out.jsonl",
    )
    return job_id


def _outputs(factory, job_id):
    with factory() as s:
        rows = s.scalars(select(Request).where(Request.job_id == job_id).order_by(Request.line_number)).all()
        return [(r.custom_id, r.status, r.output, r.output_tokens) for r in rows]


def test_job_through_the_engine_equals_plain_decoder(db_url, tmp_path, tiny_decoder):
    decoder = tiny_decoder("ngram")
    factory = make_session_factory(db_url)
    plain = _job(factory, tmp_path, "plain")
    run_job(factory, plain, decoder)
    engine = Engine(decoder, max_batch=4)
    engine.start()
    try:
        online = engine.stream("1 2 3 1 2 3", SamplingParams(max_new_tokens=300))
        next(online)  # an online row decodes beside the job's rows
        shared = _job(factory, tmp_path, "shared")
        report = run_job(factory, shared, engine.as_decoder())
        online.close()
    finally:
        engine.stop()
    assert report.finalized
    assert _outputs(factory, shared) == _outputs(factory, plain)
    assert [s for _, s, _, _ in _outputs(factory, shared)].count("completed") == len(PROMPTS)
    assert engine.most_rows >= 2
