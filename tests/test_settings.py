"""Settings from the environment, and URLs shown without their secrets."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from spec_batch.settings import get_settings, redact, shown_url

SECRET_URLS = [
    ("postgresql://spec:pw-secret@db:5432/jobs", "postgresql://spec:***@db:5432/jobs"),
    (
        "postgresql://spec@db/jobs?sslmode=require&password=q-secret",
        "postgresql://spec@db/jobs?sslmode=require&password=***",
    ),
    ("redis://:r-secret@broker:6379/0", "redis://:***@broker:6379/0"),
    (
        "rediss://broker:6380/0?password=t-secret&ssl_cert_reqs=none",
        "rediss://broker:6380/0?password=***&ssl_cert_reqs=none",
    ),
    ("sqlite:////var/lib/spec/jobs.db", "sqlite:////var/lib/spec/jobs.db"),
]


@pytest.mark.parametrize("url,shown", SECRET_URLS)
def test_shown_urls_mask_passwords_and_secret_parameters(url, shown):
    assert shown_url(url) == shown


def test_redact_masks_a_secret_wherever_a_message_quotes_it():
    url = "postgresql://spec@db/jobs?password=q-secret"
    msg = f"connection to {url} failed: password authentication failed (sent 'q-secret')"
    assert (
        redact(msg, url) == "connection to postgresql://spec@db/jobs?password=*** failed: password "
        "authentication failed (sent '***')"
    )


def test_device_and_threads_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_DEVICE", raising=False)
    monkeypatch.delenv("SPEC_BATCH_TORCH_THREADS", raising=False)
    assert (get_settings().device, get_settings().torch_threads) == (None, None)
    monkeypatch.setenv("SPEC_BATCH_DEVICE", "cuda:1")
    monkeypatch.setenv("SPEC_BATCH_TORCH_THREADS", "3")
    assert (get_settings().device, get_settings().torch_threads) == ("cuda:1", 3)


def test_tree_width_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_TREE_WIDTH", raising=False)
    assert get_settings().tree_width is None  # the head's own default
    monkeypatch.setenv("SPEC_BATCH_TREE_WIDTH", "3")
    assert get_settings().tree_width == 3
    monkeypatch.setenv("SPEC_BATCH_TREE_WIDTH", "wide")
    with pytest.raises(ValueError, match="SPEC_BATCH_TREE_WIDTH='wide' is not an integer"):
        get_settings()


@pytest.mark.parametrize("command", [["jobs"], ["generate", "Hi"]])
def test_a_malformed_variable_is_a_one_line_error_of_the_cli(command, tmp_path, monkeypatch):
    from spec_batch.cli import main

    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'jobs.db'}")
    monkeypatch.setenv("SPEC_BATCH_TREE_WIDTH", "wide")
    result = CliRunner().invoke(main, command)
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)  # click's error exit, no traceback
    assert "Error: SPEC_BATCH_TREE_WIDTH='wide' is not an integer" in result.output


@pytest.mark.parametrize(
    "args,env",
    [
        (["jobs"], {"SPEC_BATCH_DATABASE_URL": "postgresql://spec:pw-secret@127.0.0.1:1/jobs?password=q-secret"}),
        (["db", "upgrade", "--url", "postgresql://spec:pw-secret@127.0.0.1:1/jobs?password=q-secret"], {}),
        (["submit", "{batch}"], {"SPEC_BATCH_BROKER_URL": "redis://:pw-secret@127.0.0.1:1/0?password=q-secret"}),
    ],
    ids=["database", "db-url-option", "broker"],
)
def test_cli_errors_never_print_a_secret(args, env, tmp_path, monkeypatch):
    from spec_batch.cli import main

    batch = tmp_path / "b.jsonl"
    batch.write_text('{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x"}}\n')
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'j.db'}")
    res = CliRunner().invoke(
        main,
        [a.replace("{batch}", str(batch)) for a in args] + (["--no-model-check"] if args[0] == "submit" else []),
        env=env,
    )
    assert res.exit_code != 0
    assert "secret" not in res.output and "***" in res.output, res.output


def test_api_keys_come_from_the_variable_and_the_file_together(monkeypatch, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("# team a\nkey-one\n\nkey-two\n")
    monkeypatch.setenv("SPEC_BATCH_API_KEYS", " key-zero, ,key-one")
    monkeypatch.setenv("SPEC_BATCH_API_KEYS_FILE", str(keys))
    assert get_settings().api_keys == ("key-zero", "key-one", "key-two")


def test_an_unreadable_keys_file_or_unknown_runner_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SPEC_BATCH_API_KEYS_FILE", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="SPEC_BATCH_API_KEYS_FILE"):
        get_settings()
    monkeypatch.delenv("SPEC_BATCH_API_KEYS_FILE")
    monkeypatch.setenv("SPEC_BATCH_API_RUNNER", "cluster")
    with pytest.raises(ValueError, match="SPEC_BATCH_API_RUNNER='cluster'"):
        get_settings()


def test_retention_and_docs_settings(monkeypatch):
    from spec_batch.settings import SettingsError

    monkeypatch.delenv("SPEC_BATCH_RETENTION_DAYS", raising=False)
    monkeypatch.delenv("SPEC_BATCH_API_DOCS", raising=False)
    assert get_settings().retention_days is None and get_settings().api_docs is False  # both off by default
    monkeypatch.setenv("SPEC_BATCH_RETENTION_DAYS", "30")
    monkeypatch.setenv("SPEC_BATCH_API_DOCS", "1")
    assert get_settings().retention_days == 30.0 and get_settings().api_docs is True
    monkeypatch.setenv("SPEC_BATCH_RETENTION_DAYS", "0")
    assert get_settings().retention_days is None
    for bad in ("-1", "soon", "inf"):
        monkeypatch.setenv("SPEC_BATCH_RETENTION_DAYS", bad)
        with pytest.raises(SettingsError, match="SPEC_BATCH_RETENTION_DAYS"):
            get_settings()


def test_the_servers_latency_slack_comes_from_the_environment_and_the_flag(monkeypatch):
    from spec_batch.cli import main

    monkeypatch.delenv("SPEC_BATCH_LATENCY_SLACK", raising=False)
    assert get_settings().latency_slack == 0.1  # the server's default
    monkeypatch.setenv("SPEC_BATCH_LATENCY_SLACK", "0.25")
    assert get_settings().latency_slack == 0.25
    monkeypatch.setenv("SPEC_BATCH_LATENCY_SLACK", "off")
    assert get_settings().latency_slack is None  # tokens/s alone, as jobs run
    monkeypatch.setenv("SPEC_BATCH_LATENCY_SLACK", "-1")
    with pytest.raises(ValueError, match="SPEC_BATCH_LATENCY_SLACK='-1' must be a share >= 0"):
        get_settings()
    monkeypatch.delenv("SPEC_BATCH_LATENCY_SLACK")
    result = CliRunner().invoke(main, ["serve", "--latency-slack", "soon"])
    assert result.exit_code == 2 and "--latency-slack='soon' is not a number" in result.output


def test_a_decoders_latency_slack_reaches_its_policy_and_its_copies(tiny_decoder):
    dec = tiny_decoder("ngram", latency_slack=0.2)
    assert dec.policy.latency_slack == 0.2
    assert dec.with_drafter(dec.drafter_factory).policy.latency_slack == 0.2
    assert tiny_decoder("ngram").policy.latency_slack is None  # a bulk job's: tokens/s alone
