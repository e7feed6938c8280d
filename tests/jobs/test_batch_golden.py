"""Golden files: a batch file of every kind of line, through validation, the store and export, byte for byte.

The input (tests/jobs/golden/batch_input.jsonl) holds successes (stop and length, chat and completions, a
structured output) and errors of several kinds (invalid JSON, missing custom_id, unknown field, out-of-range
value, bad response_format, duplicate custom_id, a max_tokens beyond the context, a failure while decoding).
Results are stored with fixed statistics and times, so the output and error files are deterministic.
Regenerate after an intended format change with SPEC_BATCH_REGEN_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from spec_batch.core.outputs import GenerationResult, RequestStats
from spec_batch.jobs.export import write_results
from spec_batch.jobs.service import create_job_from_file
from spec_batch.store import make_session_factory, queries
from spec_batch.store.db import migrate_to_head

GOLDEN = Path(__file__).parent / "golden"
DONE_AT = datetime(2024, 1, 2, 3, 4, 5, tzinfo=UTC)

# custom_id -> (text, finish_reason, stats) of a stored result; "decode_error" stores a failure
RESULTS = {
    "chat-stop": (
        "Paris.",
        "stop",
        dict(
            prompt_tokens=12,
            output_tokens=3,
            draft_tokens=4,
            accepted_tokens=2,
            target_forwards=2,
            accepted_length_histogram=[0, 0, 1],
            wall_s=0.5,
        ),
    ),
    "comp-length": ("upon a time", "length", dict(prompt_tokens=2, output_tokens=4, target_forwards=4, wall_s=0.25)),
    "comp-ids": (" there", "stop", dict(prompt_tokens=3, output_tokens=1, target_forwards=1, wall_s=0.125)),
    "chat-json": (
        '{"name": "Ada", "age": 36}',
        "stop",
        dict(
            prompt_tokens=20,
            output_tokens=9,
            draft_tokens=6,
            accepted_tokens=6,
            target_forwards=3,
            draft_forwards=6,
            forced_tokens=5,
            accepted_length_histogram=[0, 0, 0, 3],
            wall_s=1.0,
        ),
    ),
    "chat-unicode": ("Grüße ✓", "stop", dict(prompt_tokens=5, output_tokens=2, target_forwards=2, wall_s=0.5)),
    "chat-fails": (None, "error", dict(prompt_tokens=7)),
}


def _store_results(factory, job_id: str) -> None:
    with factory.begin() as s:
        rows = [(r.id, r.custom_id) for r in queries.iter_requests(s, job_id) if r.endpoint is not None]
    for rid, cid in rows:
        text, finish, stats = RESULTS[cid]
        result = GenerationResult(
            text or "",
            [],
            finish,
            RequestStats(**stats),
            error="prompt 0: the prompt is too long" if finish == "error" else None,
        )
        with factory.begin() as s:
            assert queries.save_result(s, rid, result, worker="w", now=DONE_AT)


def test_output_and_error_files_are_byte_identical_to_the_golden_files(tmp_path):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate_to_head(url)
    factory = make_session_factory(url)
    job_id, report = create_job_from_file(
        factory,
        GOLDEN / "batch_input.jsonl",
        target="tiny-target",
        drafter="ngram",
        job_id="job_golden",
        max_context=64,
    )
    assert len(report.requests) == len(RESULTS)
    with factory() as s:  # invalid lines keep their custom_id in SQL (migration 0005), even a duplicate one
        stored = {r.line_number: r.custom_id for r in queries.iter_requests(s, job_id) if r.endpoint is None}
    assert stored == {
        3: None,
        4: None,
        5: "unknown-field",
        6: "too-hot",
        9: "bad-format",
        10: "chat-stop",
        12: "too-long",
        15: "bad-url",
    }
    _store_results(factory, job_id)
    out = tmp_path / "out.jsonl"
    write_results(factory, job_id, out)
    for produced, golden in (
        (out, GOLDEN / "batch_output.jsonl"),
        (tmp_path / "out.errors.jsonl", GOLDEN / "batch_output.errors.jsonl"),
    ):
        if os.environ.get("SPEC_BATCH_REGEN_GOLDEN"):
            golden.write_bytes(produced.read_bytes())
        assert produced.read_bytes() == golden.read_bytes(), f"{golden.name} changed: diff it against {produced}"
