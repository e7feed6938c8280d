"""The CLI's default configuration end to end: `spec-batch run` with SPEC_BATCH_WEIGHTS unset runs `auto`, which is
w4a8 on the CPU where the native kernels build; the job records the resolved weights, and its speculative outputs
equal plain decoding at those weights token for token."""

from __future__ import annotations

import json

import pytest
from batch_lines import completion_line, write_batch
from click.testing import CliRunner

from spec_batch import SamplingParams, load_decoder
from spec_batch.cli import _common, main
from spec_batch.loading.kernels.build import native_ops
from spec_batch.store import make_session_factory, queries

pytestmark = pytest.mark.skipif(not native_ops("auto"), reason="no C++ compiler: auto is full here")


def test_run_defaults_to_w4a8_and_equals_plain_decoding_there(tmp_path, monkeypatch) -> None:
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    monkeypatch.delenv("SPEC_BATCH_WEIGHTS", raising=False)  # tests/conftest.py pins full for the other tests
    prompts = ["Rewrite politely: send me the report now.", "List three colours, comma separated:"]
    batch = write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    )
    out = tmp_path / "out.jsonl"
    res = CliRunner().invoke(
        main, ["run", str(batch), "-o", str(out), "--target", "default", "--draft", "suffix", "--baseline-sample", "0"]
    )
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    job_id = res.stdout.splitlines()[0]
    with make_session_factory(url)() as session:
        job = queries.get_job(session, job_id)
        assert (job.weights, job.dtype) == ("w4a8", "float32")
    got = {row["custom_id"]: row for row in map(json.loads, out.read_text().splitlines())}
    plain = load_decoder("default", "none", weights="w4a8")
    want = plain.generate(prompts, SamplingParams(max_new_tokens=12))
    for i, expected in enumerate(want):
        assert got[f"r{i}"]["response"]["body"]["choices"][0]["text"] == expected.text
