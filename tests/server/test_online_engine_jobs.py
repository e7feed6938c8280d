"""A bulk job decoded through the server's engine (`engine.as_decoder()`, what `ctx.decoder` holds) while
an online stream shares its steps: the job's stored outputs equal those of the same job through a plain Decoder
(the runner's on_result, return_errors, should_stop and the baseline's without_speculation all work on it).
A batch the server runs drafts with its job's memory (online requests without one), and with a fixed draft length
and nothing else in the engine its requests accept what `spec-batch run` accepts on the same file."""

from __future__ import annotations

import dataclasses
import io
import json
import time

from batch_lines import completion_line, write_batch
from click.testing import CliRunner
from sqlalchemy import select

from spec_batch import SamplingParams
from spec_batch.cli import jobs as cli_jobs
from spec_batch.cli import main
from spec_batch.core.drafting.job_memory import JobMemory
from spec_batch.core.drafting.suffix_drafter import SuffixDrafter
from spec_batch.core.engine import Engine
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.server.batch_create import create_batch
from spec_batch.server.file_io import store_upload
from spec_batch.server.serve import ServeOptions, build_context
from spec_batch.settings import get_settings
from spec_batch.store import Request, make_session_factory, queries

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


# a copying job: the suffix drafter has something to draft from each prompt and from the job's other outputs
BATCH_PROMPTS = [f"{a} {a + 1} {a + 2} 1 2 3 {a} {a + 1}" for a in range(10, 22)]


def _serve_batch(decoder, db_url, prompts: list[str], max_tokens: int = 16, during=None) -> str:
    """Runs the prompts as a batch of the server's local runner (in process, on an engine over `decoder`);
    during(engine) runs once the batch is submitted."""
    factory = make_session_factory(db_url)
    settings = dataclasses.replace(get_settings(), database_url=db_url, api_runner="local")
    ctx = build_context(settings, ServeOptions(target="tiny", draft="suffix"), factory, decoder=decoder)
    for service in ctx.services:
        service.start()
    try:
        lines = [
            json.dumps(
                {"custom_id": f"r{i}", "url": "/v1/completions", "body": {"prompt": p, "max_tokens": max_tokens}}
            )
            for i, p in enumerate(prompts)
        ]
        file_id = store_upload(
            factory,
            io.BytesIO("\n".join(lines).encode()),
            owner=None,
            filename="in.jsonl",
            purpose="batch",
            max_bytes=1 << 20,
            max_lines=100,
        )
        runner = ctx.batches
        batch_id = create_batch(
            factory,
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
        if during is not None:
            during(ctx.engine)
        deadline = time.monotonic() + 120
        while True:
            with factory() as s:
                if queries.get_job(s, batch_id).status == "completed":
                    return batch_id
            assert time.monotonic() < deadline, "the batch did not complete"
            time.sleep(0.05)
    finally:
        for service in reversed(ctx.services):
            service.stop()


def _accepted(db_url, job_id: str) -> dict[str, tuple]:
    with make_session_factory(db_url)() as s:
        rows = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        return {r.custom_id: (r.status, r.output, r.draft_tokens, r.accepted_tokens) for r in rows}


class _MemoryWatch(SuffixDrafter):
    """The suffix drafter, noting the memory each row joined with (by its prompt's first token)."""

    joined: list[tuple[int, JobMemory | None]] = []

    def admit(self, rows, memory=None) -> None:
        self.joined.extend((row.tokens[0], memory) for row in rows)
        super().admit(rows, memory)


def test_a_served_batch_drafts_with_its_jobs_memory_and_online_requests_without(db_url, tiny_decoder):
    decoder = tiny_decoder("suffix").with_drafter(_MemoryWatch)
    _MemoryWatch.joined = []
    online = []

    def online_request(engine) -> None:  # an online request beside the batch's rows
        online.append(list(engine.stream("60 61 62 60 61", SamplingParams(max_new_tokens=40))))

    batch_id = _serve_batch(decoder, db_url, BATCH_PROMPTS, during=online_request)
    memories = {id(m): m for first, m in _MemoryWatch.joined if m is not None}
    assert len(memories) == 1  # one memory: the job's
    (memory,) = memories.values()
    # the baseline sample's rows (8 by default, spread over the file) decode without it; the others with it
    with_memory = [first for first, m in _MemoryWatch.joined if m is memory]
    assert len(with_memory) == len(BATCH_PROMPTS) - 8
    assert set(with_memory) <= {int(p.split()[0]) for p in BATCH_PROMPTS}
    assert len(memory) >= len(with_memory)  # their outputs went into it
    assert [m for first, m in _MemoryWatch.joined if first == 60] == [None]  # the online request: no memory
    assert online and _accepted(db_url, batch_id)["r11"][0] == "completed"


def test_a_served_batch_accepts_what_spec_batch_run_accepts(db_url, tmp_path, monkeypatch, tiny_decoder):
    """adaptive=False (a fixed draft length) and no other rows in the engine: the same steps, the same drafts."""
    served = _serve_batch(tiny_decoder("suffix", adaptive=False), db_url, BATCH_PROMPTS)
    run_decoder = tiny_decoder("suffix", adaptive=False)
    monkeypatch.setattr(cli_jobs, "_load_decoder", lambda *args: run_decoder)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", db_url)
    path = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=16) for i, p in enumerate(BATCH_PROMPTS)]
    )
    res = CliRunner().invoke(main, ["run", str(path), "-o", str(tmp_path / "out.jsonl")])
    assert res.exit_code == 0, res.output
    ran = _accepted(db_url, res.stdout.splitlines()[0])
    assert _accepted(db_url, served) == ran
    assert sum(accepted for *_, accepted in ran.values()) > 0
