"""Batch files: OpenAI Batch API input lines, every kind of bad line, output and error lines."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from spec_batch.jobs.batch_input import (
    CHAT,
    COMPLETIONS,
    DUPLICATE_CUSTOM_ID,
    INVALID_JSON,
    INVALID_LINE,
    INVALID_VALUE,
    MISSING_CUSTOM_ID,
    MISSING_FIELD,
    UNSUPPORTED_ENDPOINT,
    UNSUPPORTED_FIELD,
    BatchLineError,
    parse_line,
    parse_lines,
    read_batch_file,
)
from spec_batch.jobs.batch_output import error_line, errors_path_for, output_line


def chat(body_extra=None, **top):
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": CHAT,
        "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "hi"}], **(body_extra or {})},
    }
    line.update(top)
    return json.dumps(line)


def comp(body_extra=None, **top):
    line = {"custom_id": "a", "method": "POST", "url": COMPLETIONS, "body": {"prompt": "Once", **(body_extra or {})}}
    line.update(top)
    return json.dumps(line)


def test_valid_chat_line_with_defaults():
    req = parse_line(chat(), 3, defaults={"max_new_tokens": 50, "temperature": 0.0})
    assert req.line_number == 3 and req.custom_id == "a" and req.endpoint == CHAT
    assert req.prompt == [{"role": "user", "content": "hi"}]
    assert req.params.max_new_tokens == 50 and req.params.temperature == 0.0 and req.params.stop == []
    assert req.model == "gpt-4o-mini"


def test_valid_line_values_override_defaults():
    req = parse_line(
        chat({"max_tokens": 7, "temperature": 0.7, "top_p": 0.9, "seed": 42, "stop": "END", "n": 1}),
        1,
        defaults={"max_new_tokens": 50},
    )
    p = req.params
    assert (p.max_new_tokens, p.temperature, p.top_p, p.seed, p.stop) == (7, 0.7, 0.9, 42, ["END"])
    assert req.params.to_dict() == {
        "max_new_tokens": 7,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 0,
        "seed": 42,
        "stop": ["END"],
        "response_format": None,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "logit_bias": {},
        "logprobs": False,
        "top_logprobs": 0,
    }


def test_max_completion_tokens_and_content_parts_and_nulls():
    req = parse_line(
        json.dumps(
            {
                "custom_id": "x",
                "method": "POST",
                "url": CHAT,
                "body": {
                    "messages": [
                        {
                            "role": "system",
                            "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
                        },
                        {"role": "user", "content": "go"},
                    ],
                    "max_completion_tokens": 9,
                    "temperature": None,
                    "stop": None,
                    "seed": None,
                },
            }
        ),
        1,
    )
    assert req.params.max_new_tokens == 9 and req.params.temperature == 0.0
    assert req.prompt[0] == {"role": "system", "content": "be brief"}


def test_completions_prompt_string_or_token_ids_and_method_optional():
    assert parse_line(comp(), 1).prompt == "Once"
    line = json.loads(comp({"prompt": [1, 2, 3]}))
    del line["method"]
    assert parse_line(json.dumps(line), 1).prompt == [1, 2, 3]


BAD_LINES = [
    # (line text, code, param, words in the message)
    ('{"custom_id": "a", "url": ', INVALID_JSON, None, "not valid JSON"),
    ("[1, 2]", INVALID_LINE, None, "JSON object"),
    (json.dumps({"method": "POST", "url": CHAT, "body": {}}), MISSING_CUSTOM_ID, "custom_id", "custom_id is missing"),
    (chat(custom_id=""), INVALID_VALUE, "custom_id", "non-empty string"),
    (chat(custom_id=7), INVALID_VALUE, "custom_id", "non-empty string"),
    (chat(custom_id="x" * 600), INVALID_VALUE, "custom_id", "at most 512"),
    (chat(extra=1), UNSUPPORTED_FIELD, "extra", "unsupported field"),
    (chat(method="GET"), INVALID_VALUE, "method", "POST"),
    (json.dumps({"custom_id": "a", "method": "POST", "body": {}}), MISSING_FIELD, "url", "url is missing"),
    (chat(url="/v1/embeddings"), UNSUPPORTED_ENDPOINT, "url", "/v1/embeddings"),
    (chat(url="/v1/responses"), UNSUPPORTED_ENDPOINT, "url", "not supported"),
    (json.dumps({"custom_id": "a", "method": "POST", "url": CHAT}), MISSING_FIELD, "body", "body is missing"),
    (chat(body="hi"), INVALID_VALUE, "body", "object"),
    (chat({"frobnicate": True}), UNSUPPORTED_FIELD, "body.frobnicate", "unsupported field"),
    (chat({"logprobs": "yes"}), INVALID_VALUE, "body.logprobs", "true or false"),
    (chat({"tools": []}), INVALID_VALUE, "body.tools", "non-empty list"),
    (chat({"stream": False}), UNSUPPORTED_FIELD, "body.stream", "unsupported field"),
    (chat({"top_k": 5}), UNSUPPORTED_FIELD, "body.top_k", "unsupported field"),
    (comp({"max_completion_tokens": 5}), UNSUPPORTED_FIELD, "body.max_completion_tokens", "unsupported"),
    (comp({"messages": []}), UNSUPPORTED_FIELD, "body.messages", "unsupported"),
    (json.dumps({"custom_id": "a", "url": CHAT, "body": {"model": "m"}}), MISSING_FIELD, "body.messages", "missing"),
    (chat({"messages": []}), INVALID_VALUE, "body.messages", "non-empty list"),
    (chat({"messages": "hi"}), INVALID_VALUE, "body.messages", "non-empty list"),
    (chat({"messages": [{"role": "robot", "content": "x"}]}), INVALID_VALUE, "body.messages[0].role", "robot"),
    (
        chat({"messages": [{"role": "tool", "content": "x", "tool_call_id": "c", "name": "bob"}]}),
        UNSUPPORTED_FIELD,
        "body.messages[0].name",
        "unsupported message field",
    ),
    (
        chat({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}),
        INVALID_VALUE,
        "body.messages[0].content[0]",
        "text parts",
    ),
    (chat({"messages": [{"role": "user", "content": None}]}), INVALID_VALUE, "body.messages[0].content", "string"),
    (chat({"messages": ["hi"]}), INVALID_VALUE, "body.messages[0]", "object"),
    (json.dumps({"custom_id": "a", "url": COMPLETIONS, "body": {}}), MISSING_FIELD, "body.prompt", "missing"),
    (comp({"prompt": ["a", [1]]}), INVALID_VALUE, "body.prompt", "not a mix"),
    (comp({"prompt": ["a"] * 65, "n": 2}), INVALID_VALUE, "body.prompt", "at most 128 choices"),
    (comp({"prompt": [[1], [2.5]]}), INVALID_VALUE, "body.prompt[1]", "list of token ids"),
    (comp({"prompt": ""}), INVALID_VALUE, "body.prompt", "non-empty"),
    (chat({"max_tokens": 0}), INVALID_VALUE, "body.max_tokens", ">= 1"),
    (chat({"max_tokens": "10"}), INVALID_VALUE, "body.max_tokens", "integer"),
    (chat({"max_tokens": True}), INVALID_VALUE, "body.max_tokens", "integer"),
    (chat({"max_tokens": 10.5}), INVALID_VALUE, "body.max_tokens", "integer"),
    (chat({"max_completion_tokens": -1}), INVALID_VALUE, "body.max_completion_tokens", ">= 1"),
    (chat({"max_tokens": 5, "max_completion_tokens": 5}), INVALID_VALUE, "body.max_completion_tokens", "not both"),
    (chat({"temperature": 3}), INVALID_VALUE, "body.temperature", "[0, 2]"),
    (chat({"temperature": -0.1}), INVALID_VALUE, "body.temperature", "[0, 2]"),
    (chat({"temperature": "hot"}), INVALID_VALUE, "body.temperature", "[0, 2]"),
    (chat({"top_p": 0}), INVALID_VALUE, "body.top_p", "(0, 1]"),
    (chat({"top_p": 1.5}), INVALID_VALUE, "body.top_p", "(0, 1]"),
    (chat({"seed": 1.5}), INVALID_VALUE, "body.seed", "integer"),
    (chat({"stop": ["a", "b", "c", "d", "e"]}), INVALID_VALUE, "body.stop", "at most 4"),
    (chat({"stop": [""]}), INVALID_VALUE, "body.stop", "non-empty"),
    (chat({"stop": 5}), INVALID_VALUE, "body.stop", "string"),
    (chat({"n": 129}), INVALID_VALUE, "body.n", "[1, 128]"),
    (chat({"model": 3}), INVALID_VALUE, "body.model", "string"),
]


@pytest.mark.parametrize(
    "text,code,param,words", BAD_LINES, ids=[f"{b[1]}:{b[2]}:{i}" for i, b in enumerate(BAD_LINES)]
)
def test_every_kind_of_bad_line(text, code, param, words):
    with pytest.raises(BatchLineError) as info:
        parse_line(text, 4)
    err = info.value
    assert err.code == code
    assert err.param == param
    assert words in err.message


def test_parse_lines_keeps_valid_lines_and_numbers_every_bad_one():
    lines = [
        chat(custom_id="a"),
        "",  # blank lines are skipped but counted in line numbers
        "{oops",
        chat(custom_id="b", url="/v1/embeddings"),
        chat(custom_id="a"),  # duplicate of line 1
        comp(custom_id="c"),
        "   ",
        chat({"frobnicate": True}, custom_id="d"),
        comp(custom_id="d"),  # d was used by an (invalid) line: still a duplicate
    ]
    report = parse_lines(lines)
    assert [r.custom_id for r in report.requests] == ["a", "c"]
    assert [(e.line_number, e.code) for e in report.errors] == [
        (3, INVALID_JSON),
        (4, UNSUPPORTED_ENDPOINT),
        (5, DUPLICATE_CUSTOM_ID),
        (8, UNSUPPORTED_FIELD),
        (9, DUPLICATE_CUSTOM_ID),
    ]
    assert report.n_lines == 7
    dup = report.errors[2]
    assert dup.message.startswith("line 5:") and "already used on line 1" in dup.message and dup.custom_id == "a"
    assert all(e.message.startswith(f"line {e.line_number}:") for e in report.errors)
    assert [e.line_number for e in report.entries()] == [1, 3, 4, 5, 6, 8, 9]


def test_read_batch_file_bytes_bom_crlf_and_bad_utf8(tmp_path):
    p = tmp_path / "in.jsonl"
    p.write_bytes(
        b"\xef\xbb\xbf"
        + chat(custom_id="a").encode()
        + b"\r\n"
        + b'{"custom_id": "\xff"}\n'
        + comp(custom_id="b").encode()
    )
    report = read_batch_file(p)
    assert [r.custom_id for r in report.requests] == ["a", "b"]
    assert report.requests[0].raw == chat(custom_id="a")  # BOM and CRLF stripped
    assert len(report.errors) == 1 and report.errors[0].code == INVALID_LINE and "UTF-8" in report.errors[0].message


def test_errors_path_is_beside_the_output(tmp_path):
    assert errors_path_for(tmp_path / "out.jsonl") == tmp_path / "out.errors.jsonl"
    assert errors_path_for("res").name == "res.errors.jsonl"


def _row(**kw):
    base = dict(
        id=12,
        custom_id="r1",
        line_number=3,
        input=chat(custom_id="r1"),
        endpoint=CHAT,
        status="completed",
        output="Hello.",
        finish_reason="stop",
        error_code=None,
        error_param=None,
        error=None,
        prompt_tokens=20,
        output_tokens=6,
        draft_tokens=8,
        accepted_tokens=4,
        target_forwards=2,
        draft_forwards=0,
        accepted_length_histogram=[0, 1, 1],
        wall_s=0.5,
        forced_tokens=3,
        completed_at=datetime(2025, 1, 1, tzinfo=UTC),
        choices=None,
        options=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


def test_output_line_is_openai_shaped_with_speculative_usage():
    line = output_line(_row(), model="default", drafter="ngram")
    assert line["id"] == "batch_req_12" and line["custom_id"] == "r1" and line["error"] is None
    assert line["response"]["status_code"] == 200
    body = line["response"]["body"]
    assert body["object"] == "chat.completion" and body["model"] == "default"
    assert body["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": "Hello."}, "logprobs": None, "finish_reason": "stop"}
    ]
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (20, 6, 26)
    spec = usage["speculative"]
    assert spec["acceptance_rate"] == 0.5 and spec["tokens_per_step"] == 3.0 and spec["drafter"] == "ngram"
    assert spec["tokens_per_s"] == 12.0 and spec["forced_tokens"] == 3
    comp_line = output_line(_row(endpoint=COMPLETIONS, output=" there"), model="m", drafter="none")
    assert comp_line["response"]["body"]["object"] == "text_completion"
    assert comp_line["response"]["body"]["choices"][0]["text"] == " there"
    json.dumps(line)


def test_error_lines_for_invalid_lines_and_decode_failures():
    invalid = _row(
        custom_id="r1",
        endpoint=None,
        status="failed",
        error_code=UNSUPPORTED_FIELD,
        error_param="body.logprobs",
        error="line 3: body.logprobs: unsupported field",
        output=None,
    )
    line = error_line(invalid)
    assert line["custom_id"] == "r1"  # stored with the invalid line (0005), not re-parsed from it
    assert line["response"] is None
    assert line["error"] == {
        "code": UNSUPPORTED_FIELD,
        "message": "line 3: body.logprobs: unsupported field",
        "param": "body.logprobs",
        "line": 3,
    }
    garbage = error_line(_row(custom_id=None, endpoint=None, status="failed", input="{oops", error_code=INVALID_JSON))
    assert garbage["custom_id"] is None and garbage["error"]["code"] == INVALID_JSON
    failed = error_line(_row(status="failed", error_code="decode_error", error="prompt too long", output=None))
    assert failed["error"] is None
    assert failed["response"]["status_code"] == 400
    err = failed["response"]["body"]["error"]
    assert err["code"] == "decode_error" and err["line"] == 3
    assert err["message"] == "line 3, custom_id 'r1': prompt too long"  # the line and the custom_id, no index


def test_a_negative_token_id_gets_its_own_message():
    with pytest.raises(BatchLineError) as exc:
        parse_line(comp({"prompt": [5, 9, -3]}), 4)
    assert exc.value.param == "body.prompt[2]" and exc.value.message == (
        "body.prompt[2]: token id -3 is negative; token ids are >= 0"
    )


def test_lines_the_model_cannot_run_become_invalid_lines():
    report = parse_lines(
        [
            comp({"max_tokens": 5}, custom_id="ok"),
            comp({"max_tokens": 10**12}, custom_id="huge"),
            comp({"prompt": [1, 2, 900]}, custom_id="ids"),
            chat({"max_completion_tokens": 4000}, custom_id="chat"),
            comp(custom_id="default"),
        ],
        defaults={"max_new_tokens": 256},
    )
    report.check_model_limits(max_context=2048, vocab_size=512)
    assert [r.custom_id for r in report.requests] == ["ok", "default"]
    assert [(e.line_number, e.param, e.custom_id) for e in report.errors] == [
        (2, "body.max_tokens", "huge"),
        (3, "body.prompt[2]", "ids"),
        (4, "body.max_completion_tokens", "chat"),
    ]
    assert report.errors[0].message == (
        "line 2: body.max_tokens: 1000000000000 leaves no room for the prompt in the model's context of 2048 "
        "tokens; ask for fewer than 2048 tokens"
    )
    assert (
        report.errors[1].message == "line 3: body.prompt[2]: token id 900 is not in the model's vocabulary (ids 0..511)"
    )
    report = parse_lines([comp(custom_id="default")], defaults={"max_new_tokens": 4096})
    report.check_model_limits(max_context=2048)
    assert "4096 (the job's default: --max-tokens) leaves no room" in report.errors[0].message


def _huge_file(tmp_path, megabytes=20):
    path = tmp_path / "huge.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(comp(custom_id="before") + "\n")
        fh.write('{"custom_id": "huge", "method": "POST", "url": "/v1/completions", "body": {"prompt": "')
        chunk = "word " * 200_000  # 1 MB
        for _ in range(megabytes):
            fh.write(chunk)
        fh.write('"}}\n')
        fh.write(comp(custom_id="after") + "\n")
    return path


def test_a_20_mb_line_fails_alone_fast_unread_and_is_not_kept_whole(tmp_path):
    import time
    import tracemalloc

    from spec_batch.jobs.batch_input import HEAD_BYTES, LINE_TOO_LONG

    path = _huge_file(tmp_path)
    tracemalloc.start()
    start = time.perf_counter()
    report = read_batch_file(path)
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert [r.custom_id for r in report.requests] == ["before", "after"]
    [error] = report.errors
    assert (error.line_number, error.code, error.custom_id) == (2, LINE_TOO_LONG, "huge")
    assert "over the limit of 1048576 bytes" in error.message and "SPEC_BATCH_MAX_LINE_BYTES" in error.message
    assert len(error.raw) < HEAD_BYTES + 100  # only the start is kept (and stored)
    assert peak < 8 * 2**20, f"peak {peak / 2**20:.1f} MiB: the line was read whole"  # 1 MiB limit + overhead
    assert elapsed < 10


def test_the_line_limit_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_BATCH_MAX_LINE_BYTES", "100")
    path = tmp_path / "in.jsonl"
    path.write_text(comp(custom_id="short") + "\n" + comp({"prompt": "x" * 200}, custom_id="long") + "\n")
    report = read_batch_file(path)
    assert [r.custom_id for r in report.requests] == ["short"]
    assert report.errors[0].custom_id == "long"  # read from the start of the line
    assert "limit of 100 bytes" in report.errors[0].message


def test_a_line_nested_100000_deep_fails_alone_as_invalid_json():
    deep = '{"custom_id": "x", "body": ' + "[" * 100_000 + "]" * 100_000 + "}"
    report = parse_lines([chat(custom_id="a"), deep, comp(custom_id="c")])
    assert [r.custom_id for r in report.requests] == ["a", "c"]
    assert [(e.line_number, e.code) for e in report.errors] == [(2, INVALID_JSON)]
    assert "nested too deeply" in report.errors[0].message
