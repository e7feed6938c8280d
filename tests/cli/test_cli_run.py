"""`spec-batch run` as a script sees it: the job id alone on stdout's first line, exit codes that say how the
job ended, and every file check done before the model loads (the model here is the fake decoder)."""

from __future__ import annotations

import json
import os
import stat

import pytest
from batch_lines import chat_line, completion_line, write_batch
from click.testing import CliRunner

from spec_batch.cli import _common, main
from spec_batch.cli import jobs as cli_jobs
from spec_batch.store import make_session_factory, queries


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    return url


@pytest.fixture
def loads(monkeypatch, fake_decoder_cls):
    """The decoders `run` loaded (the fake one); `loads.decoder` is handed out."""

    class Loads(list):
        decoder = fake_decoder_cls()

    calls = Loads()

    def load(target, draft, device, dtype, *precision):  # precision: --weights, --draft-weights
        calls.append((target, draft))
        return calls.decoder

    monkeypatch.setattr(cli_jobs, "_load_decoder", load)
    return calls


def _run(*args: str):
    return CliRunner().invoke(main, ["run", *args])


def _lines(tmp_path, n: int = 3, extra: tuple[str, ...] = ()):
    return write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", f"prompt {i}", max_tokens=5) for i in range(n)] + list(extra)
    )


def test_the_job_id_is_stdouts_first_line_and_a_completed_job_exits_0(env, tmp_path, loads):
    out = tmp_path / "out.jsonl"
    res = _run(str(_lines(tmp_path)), "-o", str(out), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    job_id = res.stdout.splitlines()[0]
    assert job_id.startswith("job_") and job_id.split() == [job_id]  # JOB=$(spec-batch run ... | head -1)
    assert "interrupted?" not in res.output and "resume" not in res.stderr  # no hint when nothing went wrong
    assert len(out.read_text().splitlines()) == 3
    with make_session_factory(env)() as s:
        assert queries.get_job(s, job_id).status == "completed"


def test_an_interrupted_run_says_how_to_resume_and_exits_130(env, tmp_path, loads, fake_decoder_cls):
    loads.decoder = fake_decoder_cls(interrupt_after=1)
    res = _run(str(_lines(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    job_id = res.stdout.splitlines()[0]
    assert res.exit_code == _common.EXIT_INTERRUPTED
    assert f"spec-batch resume {job_id}" in res.stderr


@pytest.mark.parametrize("lines", [[], ["{not json", json.dumps({"custom_id": "x"})]], ids=["empty", "all-invalid"])
def test_no_valid_line_fails_before_the_model_loads(env, tmp_path, loads, lines):
    path = write_batch(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    res = _run(str(path), "-o", str(out))
    assert res.exit_code == _common.EXIT_FAILED, res.output
    assert loads == []  # the model never loaded
    job_id = res.stdout.splitlines()[0]
    with make_session_factory(env)() as s:
        assert queries.get_job(s, job_id).status == "failed"
    if lines:
        assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 2


def test_lines_the_model_cannot_run_are_refused_at_validation(env, tmp_path, loads):
    path = write_batch(
        tmp_path / "in.jsonl",
        [completion_line("ok", "fine", max_tokens=5), completion_line("huge", "x", max_tokens=10**12)],
    )
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_COMPLETED, res.output
    assert "line 2: body.max_tokens: 1000000000000 leaves no room for the prompt in the model's context" in res.stderr
    assert all(prompts != ["x"] for prompts, _ in loads.decoder.generate_calls)  # never decoded


def test_the_output_is_checked_before_the_model_loads(env, tmp_path, loads):
    path = _lines(tmp_path)
    res = _run(str(path), "-o", str(path))  # -o = the input: it would be replaced by the results
    assert res.exit_code == 1 and "is the input file" in res.output
    assert path.read_text().count("custom_id") == 3

    out = tmp_path / "done.jsonl"
    out.write_text("earlier results\n")
    res = _run(str(path), "-o", str(out))
    assert res.exit_code == 1 and f"{out} already exists: pass --force" in res.output
    assert out.read_text() == "earlier results\n"

    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir()
        locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
        res = _run(str(path), "-o", str(locked / "out.jsonl"))
        assert res.exit_code == 1 and "cannot write the output" in res.output
    assert loads == []

    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the output folder should be")
    res = _run(str(path), "-o", str(blocker / "out.jsonl"))
    assert res.exit_code == 1 and "cannot write the output" in res.output

    loads.clear()
    res = _run(str(path), "-o", str(out), "--force", "--baseline-sample", "0")
    assert res.exit_code == 0 and len(out.read_text().splitlines()) == 3 and len(loads) == 1


def test_an_output_that_cannot_be_written_at_the_end_exits_4(env, tmp_path, loads, monkeypatch):
    from spec_batch.jobs import lifecycle  # finalization writes the output file

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(lifecycle, "write_results", refuse)
    res = _run(str(_lines(tmp_path)), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == _common.EXIT_OUTPUT_NOT_WRITTEN, res.output
    assert "could not write the output file" in res.stdout


def test_a_chat_line_with_a_bad_template_fails_alone(env, tmp_path, loads):
    path = write_batch(
        tmp_path / "in.jsonl", [chat_line("a", "hello", max_tokens=4), chat_line("b", "BAD TEMPLATE", max_tokens=4)]
    )
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == 0, res.output  # the job completed; the failed request is in the errors file
    err = json.loads((tmp_path / "out.errors.jsonl").read_text())
    assert err["response"]["body"]["error"]["message"].startswith("line 2, custom_id 'b': ")


def test_a_line_whose_grammar_matches_nothing_fails_alone(env, tmp_path, loads):
    path = write_batch(
        tmp_path / "in.jsonl",
        [
            completion_line("ok", "fine", max_tokens=4),
            completion_line("never", "x", max_tokens=4, response_format={"type": "regex", "pattern": "[a&&b]"}),
        ],
    )
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0")
    assert res.exit_code == 0, res.output
    [err] = [json.loads(line) for line in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert err["custom_id"] == "never"
    assert err["error"]["param"] == "body.response_format.pattern" and err["error"]["line"] == 2
    assert "response_format.pattern matches no string at all" in err["error"]["message"]
    assert all(prompts != ["x"] for prompts, _ in loads.decoder.generate_calls)  # never decoded


FAILS_MID_DECODE = {"type": "regex", "pattern": "(b|c)a{1000000}"}  # the engine gives up at its second token
SCHEMA = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"enum": ["ab", "abc", "no"]}}}


def test_a_grammar_failing_mid_decode_fails_its_line_alone(env, tmp_path, monkeypatch, tiny_decoder, byte_tokenizer):
    decoder = tiny_decoder("ngram", tokenizer=byte_tokenizer)
    monkeypatch.setattr(cli_jobs, "_load_decoder", lambda *args: decoder)
    good = [
        completion_line("r0", "abc", max_tokens=20, response_format=SCHEMA),
        completion_line("r1", "name", max_tokens=20),
        completion_line("r2", "yes no", max_tokens=20, temperature=1.0, seed=7),
    ]
    bad = completion_line("bad", "abc", max_tokens=20, response_format=FAILS_MID_DECODE)
    choices = {}
    for name, lines in (("alone", good), ("beside", [good[0], bad, *good[1:]])):
        out = tmp_path / f"{name}.jsonl"
        path = write_batch(tmp_path / f"{name}.in.jsonl", lines)
        res = _run(str(path), "-o", str(out), "--baseline-sample", "0", "--batch-size", "4")
        assert res.exit_code == _common.EXIT_COMPLETED, res.output
        lines_out = [json.loads(line) for line in out.read_text().splitlines()]
        choices[name] = {o["custom_id"]: o["response"]["body"]["choices"] for o in lines_out}
    assert choices["beside"] == choices["alone"]  # the other rows of its steps: unchanged
    [err] = [json.loads(line) for line in (tmp_path / "beside.errors.jsonl").read_text().splitlines()]
    error = err["response"]["body"]["error"]
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400 and error["line"] == 2
    assert error["param"] == "response_format" and error["code"] == "grammar_failed"
    assert "the grammar engine gave up" in error["message"] and "<state>" not in error["message"]


def test_the_baseline_message_counts_the_requests_it_samples(env, tmp_path, loads):
    path = write_batch(tmp_path / "in.jsonl", [completion_line("only", "one request", max_tokens=4), "{bad"])
    res = _run(str(path), "-o", str(tmp_path / "out.jsonl"))  # --baseline-sample 8 by default
    assert res.exit_code == 0, res.output
    assert "measuring the baseline: 1 request(s)" in res.stderr
    job_id = res.stdout.splitlines()[0]
    with make_session_factory(env)() as s:
        assert queries.get_job(s, job_id).baseline_requests == 1  # what SQL records


def test_a_batch_file_as_common_openai_tools_write_it_runs_end_to_end(env, tmp_path, monkeypatch, default_decoder):
    """user, store, metadata, tools, logprobs, penalties, n: accepted and recorded or applied, on the real default
    model through `spec-batch run`; every output line parses with the official openai client's own types."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    monkeypatch.setattr(cli_jobs, "_load_decoder", lambda *a: default_decoder)
    weather = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    common = {"user": "u-42", "store": False, "metadata": {"team": "search"}, "service_tier": "auto"}
    path = write_batch(
        tmp_path / "in.jsonl",
        [
            chat_line(
                "tools",
                "What is the weather in Paris?",
                max_tokens=24,
                tools=[weather],
                tool_choice="required",
                parallel_tool_calls=False,
                **common,
            ),
            chat_line(
                "n3",
                "Say hi.",
                max_tokens=6,
                n=3,
                temperature=1.0,
                seed=11,
                logprobs=True,
                top_logprobs=2,
                frequency_penalty=0.5,
                presence_penalty=0.2,
                logit_bias={"0": -100},
                **common,
            ),
            completion_line(
                "comp",
                "Once upon a time",
                max_tokens=6,
                n=2,
                logprobs=1,
                user="u-42",
                stream_options={"include_usage": True},
            ),
            chat_line("unknown", "hi", frobnicate=1),
        ],
    )
    out = tmp_path / "out.jsonl"
    result = _run(str(path), "-o", str(out))  # the baseline samples the one-choice line only
    assert result.exit_code == 0, result.output
    lines = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    tools = ChatCompletion.model_validate(lines["tools"]["response"]["body"])
    call = tools.choices[0].message.tool_calls[0]
    assert tools.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert set(json.loads(call.function.arguments)) == {"city"}
    n3 = ChatCompletion.model_validate(lines["n3"]["response"]["body"])
    assert [c.index for c in n3.choices] == [0, 1, 2]
    comp = Completion.model_validate(lines["comp"]["response"]["body"])
    assert [c.index for c in comp.choices] == [0, 1]
    assert comp.usage.completion_tokens >= 2
    errors = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["error"]["param"]) for e in errors] == [("unknown", "body.frobnicate")]
    factory = make_session_factory(env)
    with factory() as s:
        job_id = queries.resolve_job_id(s, result.output.splitlines()[0])
        rows = {r.custom_id: r for r in queries.iter_requests(s, job_id)}
    assert rows["tools"].options["recorded"] == {"parallel_tool_calls": False, **common}
    assert rows["comp"].options == {"n": 2, "recorded": {"user": "u-42", "stream_options": {"include_usage": True}}}
    assert rows["n3"].params["logit_bias"] == {"0": -100.0} and rows["n3"].params["top_logprobs"] == 2
    assert len(rows["n3"].choices) == 3


def test_a_20_mb_line_fails_alone_through_run_and_sql_keeps_only_its_start(env, tmp_path, loads):
    path = tmp_path / "in.jsonl"
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(completion_line("r0", "prompt", max_tokens=5) + "\n")
        fh.write('{"custom_id": "huge", "url": "/v1/completions", "body": {"prompt": "' + "word " * 4_000_000 + '"}}\n')
    out = tmp_path / "out.jsonl"
    result = _run(str(path), "-o", str(out), "--baseline-sample", "0")
    assert result.exit_code == 0, result.output
    [error] = [json.loads(x) for x in (tmp_path / "out.errors.jsonl").read_text().splitlines()]
    assert (error["custom_id"], error["error"]["line"], error["error"]["code"]) == ("huge", 2, "line_too_long")
    factory = make_session_factory(env)
    with factory() as s:
        job_id = queries.resolve_job_id(s, result.output.splitlines()[0])
        stored = [r.input for r in queries.iter_requests(s, job_id) if r.custom_id == "huge"]
    assert len(stored) == 1 and len(stored[0]) < 5000
