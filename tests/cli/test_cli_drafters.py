"""`spec-batch drafters train | list | show` end to end: a job run through `spec-batch run` (a tiny real decoder),
a head trained from its stored outputs, listed and shown from SQL, then named in `run --draft head:NAME`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from batch_lines import completion_line, write_batch
from click.testing import CliRunner

from spec_batch.cli import jobs as cli_jobs
from spec_batch.cli import main
from spec_batch.loading import build_decoder

CPU = torch.device("cpu")


@pytest.fixture
def env(tmp_path, monkeypatch):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    monkeypatch.setenv("SPEC_BATCH_CACHE", str(tmp_path / "cache"))
    return url


@pytest.fixture
def tiny(tiny_target, fake_tokenizer, monkeypatch):
    """`run` and `drafters train` load the tiny target (token ids as text) instead of a real model."""
    import spec_batch.loading as loading

    dec = build_decoder(tiny_target, fake_tokenizer, target_name="default", draft="none", device=CPU)
    loaded = []

    def load(target, draft, *rest):
        from spec_batch.jobs.heads import resolve_with_settings
        from spec_batch.loading.heads import load_head_draft

        resolved = resolve_with_settings(draft)
        loaded.append(resolved)
        head = load_head_draft(resolved, CPU, None)
        return (
            dec
            if head is None
            else build_decoder(tiny_target, fake_tokenizer, target_name="default", draft=head[0], device=CPU)
        )

    monkeypatch.setattr(cli_jobs, "_load_decoder", load)
    monkeypatch.setattr(loading, "shared_decoder", lambda *a, **k: dec)
    return loaded


def _lines(tmp_path, n: int):
    gen = torch.Generator().manual_seed(0)
    prompts = [" ".join(map(str, [1, 2, 3] + torch.randint(4, 64, (4,), generator=gen).tolist())) for _ in range(n)]
    return write_batch(
        tmp_path / "in.jsonl", [completion_line(f"r{i}", p, max_tokens=16) for i, p in enumerate(prompts)]
    )


def test_train_list_show_and_use(env, tmp_path, tiny):
    runner = CliRunner()
    res = runner.invoke(
        main, ["run", str(_lines(tmp_path, 30)), "-o", str(tmp_path / "out.jsonl"), "--baseline-sample", "0"]
    )
    assert res.exit_code == 0, res.output
    job = res.stdout.splitlines()[0]
    res = runner.invoke(main, ["drafters", "train", "notices", "--job", job, "--epochs", "2", "--draft-vocab", "32"])
    assert res.exit_code == 0, res.output
    assert "head 'notices' for default: 27 requests" in res.output and "--draft head:notices" in res.output
    res = runner.invoke(main, ["drafters", "list", "--json"])
    [row] = [json.loads(line) for line in res.stdout.splitlines()]
    assert (row["name"], row["target"], row["source_jobs"]) == ("notices", "default", [job])
    assert row["tokens_trained"] > 0 and row["heldout_accepted_length"] is not None
    shown = json.loads(runner.invoke(main, ["drafters", "show", "notices"]).stdout)
    assert shown["config"]["draft_vocab_size"] == 32 and shown["config"]["meta"]["heldout_requests"] == 3
    assert shown["config"]["shared_lm_head"] is True  # the target's LM head rows, not stored
    assert runner.invoke(main, ["drafters", "show", "nope"]).exit_code != 0
    res = runner.invoke(
        main, ["drafters", "train", "own", "--job", job, "--epochs", "1", "--draft-vocab", "32", "--own-lm-head"]
    )
    assert res.exit_code == 0, res.output
    sizes = {
        r["name"]: r for r in map(json.loads, runner.invoke(main, ["drafters", "list", "--json"]).stdout.splitlines())
    }
    assert json.loads(runner.invoke(main, ["drafters", "show", "own"]).stdout)["config"]["shared_lm_head"] is False
    assert sizes["own"]["size_bytes"] > sizes["notices"]["size_bytes"]  # its own LM head is stored
    res = runner.invoke(
        main, ["drafters", "train", "three", "--job", job, "--epochs", "1", "--draft-vocab", "32", "--layout", "eagle3"]
    )
    assert res.exit_code == 0, res.output
    config = json.loads(runner.invoke(main, ["drafters", "show", "three"]).stdout)["config"]
    assert config["layout"] == "eagle3" and len(config["target_layers"]) == 3 and config["final_norm"] is True
    assert runner.invoke(main, ["drafters", "train", "x", "--job", job, "--layout", "medusa"]).exit_code != 0
    res = runner.invoke(
        main,
        [
            "run",
            str(_lines(tmp_path, 4)),
            "-o",
            str(tmp_path / "out2.jsonl"),
            "--baseline-sample",
            "0",
            "--draft",
            "head:notices",
        ],
    )
    assert res.exit_code == 0, res.output
    assert tiny[-1].startswith("head:") and tiny[-1] != "head:notices"  # resolved to the cached directory
    outs = [json.loads(line) for line in (tmp_path / "out2.jsonl").read_text().splitlines()]
    firsts = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()][:4]
    assert [o["response"]["body"]["choices"][0]["text"] for o in outs] == [
        o["response"]["body"]["choices"][0]["text"] for o in firsts
    ]  # same prompts, same outputs


def test_langchain_models_resolve_a_head_by_name(env, tmp_path, monkeypatch, tiny_target, fake_tokenizer):
    """draft="head:NAME" in the LangChain models reaches the loader as the head's cached directory."""
    import langchain_spec._base as base
    from langchain_spec import SpeculativeLLM
    from spec_batch.core.heads.head import head_for_target
    from spec_batch.core.heads.head_train import TrainReport
    from spec_batch.jobs.head_training import TrainedHead, stored_row
    from spec_batch.store import drafters as store
    from spec_batch.store import open_store

    head = head_for_target(tiny_target, torch.arange(16), "default")
    with open_store(env).begin() as s:
        store.save_drafter(
            s, stored_row("h", TrainedHead(head, TrainReport(0, 0, 0.0, None, 0.0), 1, 0, 10, None, None), ["j"])
        )
    seen = []
    monkeypatch.setattr(base, "shared_decoder", lambda target, draft, **kw: seen.append(draft))
    SpeculativeLLM(target="default", draft="head:h")._get_decoder()
    assert seen[0].startswith("head:") and (tmp_path / "cache" / "heads") in Path(seen[0].removeprefix("head:")).parents


def test_submit_checks_no_model_for_a_head():
    """`submit --draft head:NAME` publishes without a model check: the worker resolves the name."""
    from spec_batch.cli.queue import _check_model

    for draft in ("head:notices", "hybrid:notices", "head:/somewhere/else"):
        _check_model(draft, "drafter")  # no error
