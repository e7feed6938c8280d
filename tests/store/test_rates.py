"""One definition of each rate: job_summary's acceptance_rate, tokens_per_step and tokens_per_s equal the core's
RequestStats definitions applied to the job's stored rows, on a job decoded by a real (tiny) decoder."""

from __future__ import annotations

import pytest
from batch_lines import completion_line, write_batch
from sqlalchemy import select

from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.jobs.stats import pooled, stats_by_model, stats_of_row
from spec_batch.store import Request, make_session_factory, queries, summaries


def test_the_view_and_the_python_rates_agree_on_a_real_job(db_url, tmp_path, tiny_decoder, tiny_target):
    decoder = tiny_decoder(tiny_target, num_draft_tokens=3, adaptive=False)  # self-drafting: drafts, accepted
    prompts = [[1, 2, 3, 4] * 3, [5, 6, 7] * 4, [9, 8, 7, 6, 5], [11, 12] * 5, [3] * 7, [20, 21, 22, 23]]
    lines = [completion_line(f"r{i}", p, max_tokens=6 + i) for i, p in enumerate(prompts)] + ["{not json"]
    factory = make_session_factory(db_url)
    job_id, _ = create_job_from_file(
        factory,
        write_batch(tmp_path / "in.jsonl", lines),
        target="tiny",
        drafter=decoder.draft_name,
        batch_size=2,
        baseline_sample=2,
    )
    assert run_job(factory, job_id, decoder).finalized

    with factory() as s:
        view = summaries.job_summary_row(s, job_id)
        rows = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        decode_s = queries.get_job(s, job_id).decode_wall_s
    stats = [stats_of_row(r) for r in rows]
    total = pooled(
        output_tokens=sum(x.output_tokens for x in stats),
        draft_tokens=sum(x.draft_tokens for x in stats),
        accepted_tokens=sum(x.accepted_tokens for x in stats),
        target_forwards=sum(x.target_forwards for x in stats),
        wall_s=decode_s,
    )
    assert total.draft_tokens > 0 and total.accepted_tokens > 0 and total.output_tokens > 0 and decode_s > 0
    assert view["output_tokens"] == total.output_tokens
    assert view["acceptance_rate"] == pytest.approx(total.acceptance_rate)
    assert view["tokens_per_step"] == pytest.approx(total.tokens_per_step)
    assert view["tokens_per_s"] == pytest.approx(total.tokens_per_s)
    by_model = next(r for r in stats_by_model(factory) if r["target"] == "tiny" and r["drafter"] == decoder.draft_name)
    if by_model["jobs"] == 1:  # (PostgreSQL's database is shared with other tests)
        assert by_model["acceptance_rate"] == pytest.approx(total.acceptance_rate)
        assert by_model["tokens_per_step"] == pytest.approx(total.tokens_per_step)


def test_a_row_without_statistics_has_no_rates():
    class Row:
        prompt_tokens = output_tokens = draft_tokens = accepted_tokens = target_forwards = None
        draft_forwards = accepted_length_histogram = wall_s = forced_tokens = None

    stats = stats_of_row(Row())
    assert (stats.acceptance_rate, stats.tokens_per_step, stats.tokens_per_s) == (None, None, None)
