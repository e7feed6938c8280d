"""Fixtures of the loading tests: a tiny GGUF file (llama, a 512-token slice of the default model's real
tokenizer, random weights), tiny random Llama directories, and the real default model (for `slow` tests).

- ``tiny_gguf`` (session): the tiny GGUF file; ``tiny_tokenizer_dir`` / ``tiny_tokenizer``: it converted once.
- ``tiny_dir`` (session): a tiny random Llama directory with that tokenizer (config.json, safetensors).
- ``conversions``: counts GGUF conversions (the list of converted files) for the test that asks for it.
- ``prepared_llama`` (session): builds a tiny random Llama prepared as a load prepares one (weights, fused
  projections, CPU attention), for the exactness tests of the forward.
- ``default_model`` (session): the real default model from the real cache (SPEC_BATCH_CACHE or the user cache dir;
  converted there on a machine's first run, about 20 s; then about 3 s).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from spec_batch.loading import gguf_cache, shared_model
from spec_batch.loading.load import LoadedModel
from spec_batch.loading.resolve import default_gguf_path

TINY_VOCAB = 512


def write_tiny_gguf(
    path: Path,
    *,
    n_vocab: int = TINY_VOCAB,
    hidden: int = 16,
    seed: int = 0,
    qtype: str | None = None,
    embd_qtype: str | None = None,
    ffn: int = 32,
    heads: int = 2,
    layers: int = 1,
    embd_scale: float = 0.02,
) -> Path:
    """A valid llama GGUF file: the first n_vocab tokens of the default model's tokenizer (with the
    merges among them, its special tokens and chat template) and random weights: float32, or the block
    matrices quantized by gguf's own quantizer to `qtype` (e.g. "Q4_1"), the token embeddings to `embd_qtype`
    (quantized types need hidden and ffn multiples of 32)."""
    import gguf

    reader = gguf.GGUFReader(default_gguf_path())
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
    kv_heads = 1
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny")
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
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

    def add(name: str, arr: np.ndarray, kind: str | None) -> None:
        if kind is None:
            w.add_tensor(name, arr)
            return
        qt = gguf.GGMLQuantizationType[kind]
        w.add_tensor(name, gguf.quants.quantize(arr, qt), raw_dtype=qt)

    hd = hidden // heads
    add("token_embd.weight", rand(n_vocab, hidden) * (embd_scale / 0.02), embd_qtype)  # tied: scale sharpens logits
    w.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for layer in range(layers):
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
            add(f"blk.{layer}.{name}.weight", arr, None if arr.ndim == 1 else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


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


@pytest.fixture
def conversions(monkeypatch) -> list[Path]:
    """The GGUF files converted during the test, in order (the real converter still runs)."""
    calls: list[Path] = []
    real = gguf_cache.convert_gguf

    def counting(src, out):
        calls.append(src)
        real(src, out)

    monkeypatch.setattr(gguf_cache, "convert_gguf", counting)
    return calls


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The real default model, through the process cache (so load_decoder("default", ...) shares it)."""
    return shared_model("default")


@pytest.fixture(scope="session")
def gguf_writer():
    """write_tiny_gguf, for tests that write GGUF files of their own (quantized tensors, other sizes)."""
    return write_tiny_gguf


@pytest.fixture(scope="session")
def prepared_llama():
    """make(weights, dtype, native, *, seed, layers): a tiny random Llama with sharp logits (the kernels' bf16
    inputs see real differences), its weights stored as `weights`, projections fused and CPU attention chosen
    (native: the native kernel, else float64), as loading/load.py prepares a loaded model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from spec_batch.loading.cpu_attention import use_gqa_attention
    from spec_batch.loading.cpu_linear import pack_linear_weights
    from spec_batch.loading.fused_projections import fuse_projections
    from spec_batch.loading.weights import quantize_model

    def make(weights: str, dtype: torch.dtype, native: bool, *, seed: int = 7, layers: int = 2) -> LlamaForCausalLM:
        torch.manual_seed(seed)
        config = LlamaConfig(
            hidden_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=96,
            vocab_size=64,
            attn_implementation="sdpa",
        )
        model = LlamaForCausalLM(config).eval().to(dtype)
        with torch.no_grad():
            model.lm_head.weight.mul_(20)
        if weights == "full":
            pack_linear_weights(model)
        else:
            quantize_model(model, weights, torch.bfloat16)
        fuse_projections(model)
        use_gqa_attention(model, native=native)
        return model

    return make
