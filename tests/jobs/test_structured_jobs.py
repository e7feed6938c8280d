"""Batch files with response_format: parsing, line errors with the engine's reason, jobs whose every output
validates against its schema, forced tokens stored per request and summed per job."""

from __future__ import annotations

import json

import jsonschema
import pytest
from batch_lines import chat_line, completion_line, write_batch
from sqlalchemy import select

from spec_batch.core.params import SamplingParams
from spec_batch.jobs import create_job_from_file, run_job
from spec_batch.jobs.batch_input import CHAT, COMPLETIONS, INVALID_VALUE, BatchLineError, parse_line, parse_lines
from spec_batch.jobs.batch_output import errors_path_for, iter_jsonl
from spec_batch.store import Request, make_session_factory, summaries

RECORD = {
    "type": "object",
    "properties": {
        "name": {"enum": ["ab", "abc", "no"]},
        "ok": {"type": "boolean"},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "ok", "age"],
    "additionalProperties": False,
}
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}}
BAD_SCHEMA = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strnig"}}}


@pytest.mark.parametrize(
    "line",
    [
        chat_line("a", "hi", response_format=SCHEMA_FORMAT),
        completion_line("a", "hi", response_format={"type": "regex", "pattern": "[0-9]+"}),
    ],
)
def test_response_format_is_accepted_on_both_endpoints_and_stored_as_plain_json(line):
    req = parse_line(line, 1)
    assert req.endpoint in (CHAT, COMPLETIONS)
    stored = json.loads(json.dumps(req.params.to_dict()))
    assert SamplingParams.from_dict(stored) == req.params
    assert stored["response_format"] == json.loads(line)["body"]["response_format"]


def test_text_and_null_mean_unconstrained():
    for fmt in ({"type": "text"}, None):
        assert parse_line(chat_line("a", "hi", response_format=fmt), 1).params.response_format is None


@pytest.mark.parametrize(
    "fmt, param, reason",
    [
        (BAD_SCHEMA, "body.response_format.json_schema.schema", "Invalid type: strnig"),
        ({"type": "regex", "pattern": "(?<=a)b"}, "body.response_format.pattern", "look-around"),
        (
            {"type": "json_schema", "json_schema": {"schema": RECORD}},
            "body.response_format.json_schema.name",
            "non-empty",
        ),
        ({"type": "xml"}, "body.response_format.type", "must be one of"),
    ],
)
def test_a_bad_response_format_is_a_line_error_with_the_engines_reason(fmt, param, reason):
    with pytest.raises(BatchLineError) as info:
        parse_line(chat_line("a", "hi", response_format=fmt), 1)
    assert info.value.code == INVALID_VALUE and info.value.param == param and reason in info.value.message
    report = parse_lines([chat_line("ok", "hi"), chat_line("bad", "hi", response_format=fmt)])
    assert [r.custom_id for r in report.requests] == ["ok"]
    assert report.errors[0].message.startswith("line 2: " + param)


def test_a_schema_job_validates_every_output_and_stores_forced_tokens(
    db_url, tmp_path, tiny_decoder, byte_tokenizer, tiny_draft
):
    decoder = tiny_decoder(tiny_draft, tokenizer=byte_tokenizer)
    prompts = ["abc", "name", "yes no", "true false", "age 12", "null", "abc abc", "xyz"]
    lines = [completion_line(f"r{i}", p, max_tokens=60, response_format=SCHEMA_FORMAT) for i, p in enumerate(prompts)]
    lines.insert(3, completion_line("bad", "abc", response_format=BAD_SCHEMA))
    factory = make_session_factory(db_url)
    out = tmp_path / "out.jsonl"
    job_id, _ = create_job_from_file(
        factory,
        write_batch(tmp_path / "in.jsonl", lines),
        target="tiny",
        drafter=decoder.draft_name,
        output_file=out,
        batch_size=4,
        baseline_sample=0,
    )
    assert run_job(factory, job_id, decoder).finalized
    results = list(iter_jsonl(out))
    assert len(results) == len(prompts)
    for o in results:
        choice = o["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), RECORD)
        assert o["response"]["body"]["usage"]["speculative"]["forced_tokens"] > 0
    (err,) = list(iter_jsonl(errors_path_for(out)))
    assert err["custom_id"] == "bad" and err["error"]["line"] == 4 and "Invalid type: strnig" in err["error"]["message"]
    with factory() as s:
        rows = s.scalars(select(Request).where(Request.job_id == job_id, Request.status == "completed")).all()
        summary = summaries.job_summary_row(s, job_id)
    assert all(r.forced_tokens > 0 for r in rows)
    assert summary["forced_tokens"] == sum(r.forced_tokens for r in rows)


@pytest.mark.slow
def test_a_chat_schema_job_on_the_default_model(db_url, tmp_path, default_decoder):
    person = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": person, "strict": True}}
    texts = ["Ada Lovelace was 36.", "Alan Turing, aged 41.", "Grace Hopper (85)", "Linus is 54 years old."]
    lines = [
        chat_line(f"p{i}", f"Extract name and age as JSON: {t}", max_tokens=40, response_format=fmt)
        for i, t in enumerate(texts)
    ]
    lines.append(
        chat_line(
            "mood",
            "Is the sky green? Answer yes or no.",
            max_tokens=5,
            response_format={"type": "choice", "choices": ["yes", "no"]},
        )
    )
    factory = make_session_factory(db_url)
    out = tmp_path / "out.jsonl"
    job_id, _ = create_job_from_file(
        factory,
        write_batch(tmp_path / "in.jsonl", lines),
        target=default_decoder.target_name,
        drafter=default_decoder.draft_name,
        output_file=out,
        batch_size=4,
        baseline_sample=0,
    )
    assert run_job(factory, job_id, default_decoder).finalized
    results = {o["custom_id"]: o["response"]["body"]["choices"][0] for o in iter_jsonl(out)}
    for i in range(len(texts)):
        message = results[f"p{i}"]["message"]
        assert message["role"] == "assistant" and results[f"p{i}"]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(message["content"]), person)
    assert results["mood"]["message"]["content"] in ("yes", "no")
