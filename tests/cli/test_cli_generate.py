"""`spec-batch generate` through click's CliRunner (the real default model; flag errors need no model)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from spec_batch import SamplingParams
from spec_batch.cli import main

MODEL = ["--target", "default", "--draft", "ngram"]  # explicit: SPEC_BATCH_DEFAULT_* in the environment must not matter


@pytest.fixture(scope="module")
def runner() -> CliRunner:
    return CliRunner()


def _json_lines(stdout: str) -> list[dict]:
    """--json: every non-empty line of stdout is one JSON object."""
    return [json.loads(line) for line in stdout.splitlines() if line.strip()]


@pytest.mark.slow
def test_generate_json(runner, default_decoder):
    prompt = "The capital of France is"
    result = runner.invoke(main, ["generate", prompt, "--json", "--max-new-tokens", "8", *MODEL])
    assert result.exit_code == 0, result.output
    [out] = _json_lines(result.stdout)  # stdout only: progress bars go to stderr
    assert set(out) >= {"text", "token_ids", "finish_reason", "stats"}
    assert out["finish_reason"] in ("length", "stop")
    assert isinstance(out["text"], str) and out["text"]
    assert all(isinstance(t, int) for t in out["token_ids"]) and 1 <= len(out["token_ids"]) <= 8
    stats = out["stats"]
    for key in (
        "prompt_tokens",
        "output_tokens",
        "draft_tokens",
        "accepted_tokens",
        "target_forwards",
        "accepted_length_histogram",
        "acceptance_rate",
        "tokens_per_step",
        "wall_s",
    ):
        assert key in stats, key
    assert stats["output_tokens"] == len(out["token_ids"]) + (1 if out["finish_reason"] == "stop" else 0)
    # the same as the library, greedy, token for token
    want = default_decoder.generate([prompt], SamplingParams(max_new_tokens=8))[0]
    assert out["token_ids"] == want.token_ids and out["text"] == want.text


@pytest.mark.slow
def test_generate_json_chat_several_prompts_seeded(runner, default_decoder):
    args = [
        "generate",
        "Say hi.",
        "Name a fruit.",
        "--chat",
        "--json",
        "--max-new-tokens",
        "6",
        "--temperature",
        "0.8",
        "--seed",
        "5",
        "--batch-size",
        "2",
        *MODEL,
    ]
    first = runner.invoke(main, args)
    assert first.exit_code == 0, first.output
    outs = _json_lines(first.stdout)
    assert len(outs) == 2
    second = runner.invoke(main, args)
    assert [o["token_ids"] for o in _json_lines(second.stdout)] == [o["token_ids"] for o in outs]
    ids = default_decoder.apply_chat_template([{"role": "user", "content": "Say hi."}])
    want = default_decoder.generate([ids], SamplingParams(max_new_tokens=6, temperature=0.8, seed=5))[0]
    assert outs[0]["token_ids"] == want.token_ids


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--max-new-tokens", "many"], "max-new-tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top-p"),
        (["--top-p", "1.5"], "top-p"),
        (["--top-k", "-2"], "top-k"),
        (["--batch-size", "0"], "batch-size"),
        (["--seed", "x"], "seed"),
        (["--no-such-flag"], "no-such-flag"),
        (["--response-format", "{json"], "not JSON"),
        (["--response-format", '{"type": "xml"}'], "response_format.type"),
        (["--response-format", '{"type": "regex", "pattern": "a["}'], "unclosed character class"),
        (["--response-format", "@/no/such/file.json"], "cannot read"),
        (["--temperature", "2.5"], "temperature"),  # OpenAI's range, as batch lines and LangChain
        (["--seed", str(2**63)], "seed"),  # a signed 64-bit integer
        (["--seed", str(-(2**63) - 1)], "seed"),
        (["--response-format", '{"type": "regex", "pattern": "[a&&b]"}'], "matches no string at all"),
        (["--response-format", json.dumps({"type": "regex", "pattern": r"[^\s\S]"})], "matches no string at all"),
    ],
)
def test_bad_flag_values_are_usage_errors(runner, flags, needle):
    result = runner.invoke(main, ["generate", "hello", *flags])
    assert result.exit_code == 2, result.output
    assert needle in result.output


@pytest.mark.parametrize("kind", ["missing", "folder", "binary"])
@pytest.mark.parametrize("option", ["--file", "--response-format"])
def test_unreadable_files_are_clear_errors(runner, tmp_path, monkeypatch, kind, option):
    import spec_batch

    monkeypatch.setattr(spec_batch, "load_decoder", lambda **kw: pytest.fail("no model should load"))
    path = tmp_path / "f.txt"
    if kind == "folder":
        path.mkdir()
    elif kind == "binary":
        path.write_bytes(bytes(range(128, 256)) * 4)
    value = str(path) if option == "--file" else f"@{path}"
    result = runner.invoke(main, ["generate", *(["hello"] if option != "--file" else []), option, value])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and option in result.output
    assert {"missing": "No such file", "folder": "is a folder", "binary": "is not UTF-8 text"}[kind] in result.output


def test_no_prompt_is_a_usage_error(runner):
    result = runner.invoke(main, ["generate", "--json"])
    assert result.exit_code == 2
    assert "PROMPT" in result.output


def test_unknown_target_is_a_clean_error(runner, tmp_path):
    result = runner.invoke(main, ["generate", "hi", "--target", str(tmp_path / "no-such-model")])
    assert result.exit_code == 1, result.output
    assert "no-such-model" in result.output
    assert "Traceback" not in result.output


@pytest.mark.slow
def test_generate_with_a_response_format_from_a_file(runner, tmp_path, default_decoder):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "place", "schema": schema}}
    path = tmp_path / "format.json"
    path.write_text(json.dumps(fmt), encoding="utf-8")
    prompt = "What is the capital of France? Answer in JSON."
    result = runner.invoke(
        main,
        ["generate", prompt, "--chat", "--json", "--max-new-tokens", "30", "--response-format", f"@{path}", *MODEL],
    )
    assert result.exit_code == 0, result.output
    [out] = _json_lines(result.stdout)
    assert out["finish_reason"] == "stop" and set(json.loads(out["text"])) == {"city"}
    assert out["stats"]["forced_tokens"] > 0
    inline = runner.invoke(
        main,
        [
            "generate",
            prompt,
            "--chat",
            "--json",
            "--max-new-tokens",
            "30",
            "--response-format",
            json.dumps(fmt),
            *MODEL,
        ],
    )
    assert _json_lines(inline.stdout)[0]["token_ids"] == out["token_ids"]


def test_weights_flags_are_checked_before_any_model_loads(runner):
    result = runner.invoke(main, ["generate", "hello", "--weights", "int3"])
    assert result.exit_code == 2 and "--weights" in result.output
    result = runner.invoke(main, ["generate", "hello", "--weights", "int4", "--dtype", "float16", *MODEL])
    assert result.exit_code == 1 and "float32 or bfloat16" in result.output and "Traceback" not in result.output


@pytest.mark.slow
def test_generate_json_states_the_precision_it_ran_at(runner):
    args = ["generate", "The capital of France is", "--json", "--max-new-tokens", "6", "--weights", "int4", *MODEL]
    result = runner.invoke(main, args)
    assert result.exit_code == 0, result.output
    [out] = _json_lines(result.stdout)
    assert (out["stats"]["weights"], out["stats"]["dtype"]) == ("int4", "float32")
    assert out["stats"]["draft_weights"] is None  # ngram has no model
