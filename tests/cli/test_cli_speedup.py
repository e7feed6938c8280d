"""The measured speedup's range: `spec-batch run` measures the baseline sample in interleaved
rounds and stores the lowest and highest round ratio; `show`, the HTML report and job_summary say when the
rounds disagree by more than 25% of the speedup (the load changed while it was measured)."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
from batch_lines import completion_line, write_batch
from click.testing import CliRunner
from sqlalchemy import text

from spec_batch.cli import _common, main
from spec_batch.cli import jobs as cli_jobs
from spec_batch.jobs import baseline
from spec_batch.jobs.baseline import UNRELIABLE_SPREAD, round_slices, speedup_is_reliable
from spec_batch.store import Job, make_session_factory, summaries


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    return url


def _use_decoder(monkeypatch, decoder):
    monkeypatch.setattr(cli_jobs, "_load_decoder", lambda target, draft, device, dtype, *precision: decoder)


@pytest.fixture
def virtual_time(monkeypatch, fake_decoder_cls):
    """A fake decoder class whose steps take 10 ms of a virtual clock, the clock the baseline's rounds are timed
    with: the measurement is deterministic on a busy machine. `load(seconds)` adds time outside any step."""
    clock = {"t": 0.0}

    class VirtualTime(fake_decoder_cls):
        def _step(self):
            clock["t"] += 0.01
            super()._step()

        @staticmethod
        def load(seconds: float) -> None:
            clock["t"] += seconds

    monkeypatch.setattr(baseline, "time", SimpleNamespace(perf_counter=lambda: clock["t"]))
    return VirtualTime


def _run_and_show(tmp_path, n: int = 6) -> tuple[str, str]:
    path = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", f"prompt {i}", max_tokens=24) for i in range(n)]
    )
    res = CliRunner().invoke(
        main, ["run", str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "6", "--batch-size", "2"]
    )
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    job_id = res.stdout.splitlines()[0]
    shown = CliRunner().invoke(main, ["show", job_id])
    assert shown.exit_code == 0, shown.output
    return job_id, " ".join(shown.output.split())


def _summary(url: str, job_id: str) -> dict:
    with make_session_factory(url)() as s:
        return summaries.job_summary_row(s, job_id)


def test_run_measures_rounds_and_show_gives_the_range(env, tmp_path, monkeypatch, virtual_time):
    dec = virtual_time()  # time is the steps': 3 tokens per step with speculation, 1 without
    _use_decoder(monkeypatch, dec)
    job_id, shown = _run_and_show(tmp_path)
    row = _summary(env, job_id)
    assert row["speedup_low"] <= row["speedup"] <= row["speedup_high"]
    assert row["speedup_reliable"] is True, row
    assert f"rounds {row['speedup_low']:.2f}x-{row['speedup_high']:.2f}x" in shown and "unreliable" not in shown
    # each round's slice warmed up, then 3 timed rounds of 2 requests: every sampled request decoded once (timed)
    assert [len(prompts) for prompts, _ in dec.generate_calls] == [2] * 6


def test_a_load_change_during_the_rounds_is_called_unreliable(env, tmp_path, monkeypatch, virtual_time):
    class LoadedOnce(virtual_time):
        """Another process takes the CPU during the second timed round of the speculative decoder only."""

        def generate(self, prompts, params=None, *args, **kw):
            if self.draft_name != "none" and len(self.generate_calls) == 4:  # after 3 warm-ups and one round
                self.load(0.5)
            return super().generate(prompts, params, *args, **kw)

    _use_decoder(monkeypatch, LoadedOnce())
    job_id, shown = _run_and_show(tmp_path)
    row = _summary(env, job_id)
    assert row["speedup_high"] - row["speedup_low"] > UNRELIABLE_SPREAD * row["speedup"]
    assert row["speedup_reliable"] is False
    assert "unreliable" in shown and "load changed" in shown

    from spec_batch.reports import job_report_html  # the HTML report says so too

    with make_session_factory(env)() as s:
        html = job_report_html(s, [job_id])
    assert "unreliable" in html


def test_job_summary_rule_in_sql(db_url):
    """speedup_reliable is the view's: false only when (high - low) > 25% of the speedup, NULL without a range."""
    factory = make_session_factory(db_url)
    cases = {  # (sample tokens/s over baseline tokens/s = 2.0), low, high -> reliable
        "tight": (1.8, 2.2, True),  # spread 0.4 = 20%
        "edge": (1.75, 2.25, True),  # exactly 25%
        "wide": (1.5, 2.2, False),  # 35%
        "none": (None, None, None),  # measured before 0006
    }
    ids = {}
    with factory.begin() as s:
        for name, (low, high, _) in cases.items():
            ids[name] = job_id = "job_" + os.urandom(8).hex()
            s.add(
                Job(
                    id=job_id,
                    target="t",
                    drafter="ngram",
                    sampling_defaults={},
                    status="completed",
                    baseline_requests=1,
                    baseline_output_tokens=10,
                    baseline_wall_s=1.0,
                    sample_output_tokens=20,
                    sample_wall_s=1.0,
                    speedup_low=low,
                    speedup_high=high,
                )
            )
    with factory() as s:
        for name, (low, high, reliable) in cases.items():
            row = summaries.job_summary_row(s, ids[name])
            assert row["speedup"] == pytest.approx(2.0)
            assert (row["speedup_low"], row["speedup_high"], row["speedup_reliable"]) == (low, high, reliable), name
            assert speedup_is_reliable(row["speedup"], low, high) == reliable  # Python says the same
        raw = s.execute(text("SELECT speedup_reliable FROM job_summary WHERE job_id = :j"), {"j": ids["wide"]})
        assert raw.scalar() in (False, 0)


def test_round_slices():
    assert round_slices(8) == [[0, 3, 6], [1, 4, 7], [2, 5]]
    assert round_slices(1) == [[0], [0], [0]]  # a sample smaller than the rounds repeats its requests
    assert round_slices(2) == [[0], [1], [0]]
    assert round_slices(0) == []
