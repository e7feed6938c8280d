"""Weights as they ship: int4 / int8 weight-only layers, GGUF Q4_0/Q4_1/Q8_0 blocks used as they are, and
speculation exact against plain decoding with the same weights and kernels (greedy and sampled)."""

from __future__ import annotations

import copy
import itertools

import gguf
import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn

from spec_batch import SamplingParams
from spec_batch.core.kv import padding
from spec_batch.errors import InvalidParameterError
from spec_batch.loading import build_decoder, gguf_quant, load_decoder
from spec_batch.loading.block_linear import BlockLinear
from spec_batch.loading.kernels import native_ops
from spec_batch.loading.load import load_model
from spec_batch.loading.quant_linear import Int4Linear, Int8Linear, QuantEmbedding
from spec_batch.loading.weights import quantize_model

CPU = torch.device("cpu")


def _blocks(kind: str, rows: int, cols: int, seed: int = 0) -> tuple[np.ndarray, gguf_quant.GGUFQuantTensor]:
    """A random weight quantized by gguf's own quantizer, and the blocks our reader decodes from its bytes."""
    w = (np.random.default_rng(seed).standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[kind])
    return raw, gguf_quant.decode_tensor(kind, raw, rows)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_decode_to_what_gguf_dequantizes(kind):
    raw, blocks = _blocks(kind, 48, 96)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind])
    assert np.array_equal(gguf_quant.dequantize(blocks).numpy(), want)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_q4_blocks_map_onto_int4pack_without_requantizing(kind):
    """With fp32 scales the int4 kernel computes the file's own weights (to fp32 rounding); bf16 scales round."""
    raw, blocks = _blocks(kind, 64, 128)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]))
    make = (
        (lambda dt: Int4Linear.from_q4_1(blocks.q, blocks.d, blocks.m, None, dt))
        if kind == "Q4_1"
        else (lambda dt: Int4Linear.from_q4_0(blocks.q, blocks.d, None, dt))
    )
    torch.testing.assert_close(make(torch.float32).dequantized(), weight, rtol=0, atol=1e-6)
    x = torch.randn(5, 128)
    torch.testing.assert_close(make(torch.float32)(x), x @ weight.t(), rtol=1e-5, atol=1e-5)
    assert (make(torch.bfloat16).dequantized() - weight).abs().max() < 0.01 * weight.abs().max()


def test_q8_0_per_channel_error_is_at_most_half_a_step_of_the_row_scale():
    raw, blocks = _blocks("Q8_0", 64, 128)
    weight = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q8_0))
    layer = Int8Linear.from_q8_0(blocks.q, blocks.d, None, torch.float32)
    err = (layer.dequantized() - weight).abs()
    assert bool((err <= layer.scales[:, None] / 2 + 1e-7).all())
    assert torch.equal(layer.scales, blocks.d.amax(1))  # each row keeps its largest group's scale exactly


@pytest.mark.parametrize(
    "make",
    [
        lambda w: Int4Linear.quantize(w, None, torch.bfloat16),
        lambda w: Int8Linear.quantize(w, None, torch.bfloat16),
        lambda w: Int8Linear.quantize(w, None, torch.float32),
    ],
    ids=["int4-bf16", "int8-bf16", "int8-fp32"],
)
def test_a_rows_result_does_not_depend_on_how_many_rows_are_computed(make):
    """The default model's down_proj shape: row i's numbers are the same bit for bit at every width, so a token's
    logits do not depend on the batch (or the verify step) it is computed in."""
    torch.manual_seed(0)
    layer = make(torch.randn(576, 1536) * 0.05)
    x = torch.randn(24, 1536).to(layer.act_dtype)
    with torch.inference_mode():
        full = layer(x)
        for n in range(1, 24):
            assert torch.equal(layer(x[:n]), full[:n]), n
            assert torch.equal(layer(x[n - 1 : n]), full[n - 1 : n]), n


def test_quantized_layers_compute_only_the_real_positions():
    layer = Int4Linear.quantize(torch.randn(64, 64), None, torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    valid = torch.tensor([[True, True, True], [True, False, False]])
    with torch.inference_mode():
        dense = layer(x)
        with padding.real_positions(valid):
            ragged = layer(x)
    assert torch.equal(ragged[valid], dense[valid])
    assert bool((ragged[~valid] == 0).all())


# ---------------------------------------------------------------- GGUF files with quantized tensors


@pytest.fixture(scope="module")
def q_gguf(tmp_path_factory, gguf_writer):
    """A tiny llama GGUF (2 layers, hidden 64) with Q4_1 blocks and Q8_0 token embeddings, like the default. Its tied
    embeddings are scaled up so that next-token distributions are not flat: with flat logits a bf16 rounding
    difference between batch shapes (the kernels' inputs are bf16) flips near-ties (docs/weights.md)."""
    return gguf_writer(
        tmp_path_factory.mktemp("qgguf") / "tiny-q4_1.gguf",
        hidden=64,
        ffn=64,
        layers=2,
        qtype="Q4_1",
        embd_qtype="Q8_0",
        seed=3,
        embd_scale=1.0,
    )


@pytest.fixture(scope="module")
def q_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("qcache"))


def test_a_q4_1_gguf_loads_its_blocks_as_they_ship_and_caches_them(q_gguf, q_cache, monkeypatch):
    loaded = load_model(q_gguf, weights="int4", cache_dir=q_cache)
    report = loaded.model.spec_batch_quant_report
    assert report.counts == {"Q4_1 as shipped": 14, "Q8_0 as shipped": 1}
    assert (loaded.precision.weights, loaded.precision.dtype) == ("int4", torch.float32)  # bf16 inside the kernels
    assert isinstance(loaded.model.model.embed_tokens, QuantEmbedding)  # tied: one int8 table
    assert not any(type(m) is nn.Linear for m in loaded.model.modules())
    # the layers compute the file's weights: against the dequantized model transformers loads (fp32)
    full = load_model(q_gguf, weights="full", cache_dir=q_cache).model
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        got, want = loaded.model(ids).logits.float(), full(ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    # a second load reads the cached blocks, not the GGUF file
    monkeypatch.setattr(gguf_quant, "read_quantized_linears", lambda *a, **k: pytest.fail("GGUF file read again"))
    again = load_model(q_gguf, weights="int4", cache_dir=q_cache)
    assert again.model.spec_batch_quant_report.counts == report.counts


def test_int8_keeps_q8_0_and_quantizes_q4_blocks_at_load(q_gguf, q_cache):
    counts = load_model(q_gguf, weights="int8", cache_dir=q_cache).model.spec_batch_quant_report.counts
    assert counts == {"int8 quantized at load": 14, "Q8_0 as shipped": 1}


def test_other_gguf_types_are_quantized_at_load_with_a_notice(tmp_path, gguf_writer):
    path = gguf_writer(tmp_path / "f32.gguf", hidden=64, ffn=64, qtype="F16")
    loaded = load_model(path, weights="int4", cache_dir=str(tmp_path / "cache"))
    report = loaded.model.spec_batch_quant_report
    assert report.counts == {"int4 quantized at load (GGUF F16)": 7, "int8 quantized at load (GGUF F32)": 1}
    assert any("F16" in n and "re-quantized" in n for n in report.notices)


def test_int4_computes_in_float32_or_bfloat16_and_other_dtypes_are_an_error_that_names_the_fix(q_gguf, q_cache):
    with pytest.raises(InvalidParameterError, match="float32 or bfloat16"):
        load_model(q_gguf, weights="int4", dtype="float16", cache_dir=q_cache)
    bf16 = load_model(q_gguf, weights="int4", dtype="bfloat16", cache_dir=q_cache)
    assert bf16.model.dtype == torch.bfloat16 and bf16.precision.dtype_name == "bfloat16"
    with pytest.raises(InvalidParameterError, match="weights 'int3'"):
        load_model(q_gguf, weights="int3", cache_dir=q_cache)


@pytest.mark.parametrize(
    "weights,drafter",
    [(w, d) for w in ("int4", "int8") for d in ("suffix", "ngram", "self:int4") if (w, d) != ("int4", "self:int4")]
    + [("w4a8", "suffix"), ("w4a8", "ngram")],
)
def test_speculation_is_greedy_exact_against_plain_decoding_with_the_same_weights(q_gguf, q_cache, weights, drafter):
    prompts = [
        "Hello world, hello world, hello",
        "The cat sat on the mat. The cat",
        "a b a b a b",
        "One two",
        "x y z x y z",
        "Hello",
        "The the the",
        "abc abc",
    ]
    params = SamplingParams(max_new_tokens=24)
    plain = load_decoder(q_gguf, "none", weights=weights, cache_dir=q_cache)
    want = [r.token_ids for r in plain.generate(prompts, params, batch_size=1)]
    dec = load_decoder(q_gguf, drafter, weights=weights, cache_dir=q_cache)
    assert dec.precision.target.weights == weights
    for batch_size in (1, 8):
        results = dec.generate(prompts, params, batch_size=batch_size)
        assert [r.token_ids for r in results] == want, batch_size
    # drafts are verified and accepted: with a fixed draft length, since the adaptive policy rightly switches an
    # expensive draft (self:int4) off when the clock says it does not pay, as it may on a machine busy with tests
    fixed = load_decoder(q_gguf, drafter, weights=weights, cache_dir=q_cache, adaptive=False)
    results = fixed.generate(prompts, params, batch_size=8)
    assert [r.token_ids for r in results] == want
    assert sum(r.stats.accepted_tokens for r in results) > 0


def test_self_draft_is_the_targets_own_file_at_int4(q_gguf, q_cache):
    with pytest.raises(InvalidParameterError, match="the target itself"):
        load_decoder(q_gguf, "self:int4", weights="int4", cache_dir=q_cache)
    dec = load_decoder(q_gguf, "self:int4", cache_dir=q_cache)
    assert dec.draft_name == "self:int4"
    assert dec.precision.to_dict() == {
        "weights": "full",
        "dtype": "float32",
        "draft_weights": "int4",
        "draft_dtype": "float32",
    }


# ---------------------------------------------------------------- Hugging Face models, quantized at load


@pytest.mark.parametrize("weights", ["int4", "int8", "w4a8"])
def test_a_hugging_face_directory_is_quantized_at_load(tiny_dir, weights):
    loaded = load_model(tiny_dir, weights=weights)
    counts = loaded.model.spec_batch_quant_report.counts
    assert sum(counts.values()) == 15 and f"{weights} quantized at load" in counts
    full = load_model(tiny_dir).model
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        got, want = loaded.model(ids).logits.float(), full(ids).logits
    assert (got - want).abs().max() < 0.1 * want.abs().max()


def _sequence_probs(model, prompt: list[int], vocab: int, temperature: float) -> dict[tuple[int, int], float]:
    seqs = list(itertools.product(range(vocab), repeat=2))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt + list(s) for s in seqs])).logits.float()
    logp = torch.zeros(len(seqs))
    for j in range(2):
        step = torch.log_softmax(logits[:, len(prompt) - 1 + j] / temperature, -1)
        logp += step[torch.arange(len(seqs)), torch.tensor([s[j] for s in seqs])]
    return {s: float(p) for s, p in zip(seqs, logp.exp())}


@pytest.mark.parametrize("weights", ["int4", "int8", "w4a8"])
def test_sampled_speculation_follows_the_quantized_targets_distribution(tiny_llama, fake_tokenizer, weights):
    """2000 seeded requests of 2 tokens, n-gram drafts, chi-square against the quantized target's own exact
    distribution over the 64 x 64 continuations (p > 1e-3; fixed seeds: deterministic)."""
    target = copy.deepcopy(tiny_llama(11, vocab=8, layers=2, lm_head_scale=10.0))
    quantize_model(target, weights, torch.bfloat16)
    prompt, n = [1, 2, 3, 1, 2, 3, 1, 2], 2000
    dec = build_decoder(
        target, fake_tokenizer, target_name="q", draft="ngram", device=CPU, num_draft_tokens=2, adaptive=False
    )
    results = dec.generate(
        [prompt] * n, [SamplingParams(max_new_tokens=2, temperature=1.0, seed=i) for i in range(n)], batch_size=250
    )
    counts: dict[tuple, int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    exact = _sequence_probs(target, prompt, 8, 1.0)
    big = [s for s, p in exact.items() if p * n >= 5]
    obs = [counts.get(s, 0) for s in big] + [n - sum(counts.get(s, 0) for s in big)]
    exp = [exact[s] * n for s in big] + [n - sum(exact[s] * n for s in big)]
    assert stats.chisquare(obs, [e * n / sum(exp) for e in exp]).pvalue > 1e-3
    assert 0 < sum(r.stats.accepted_tokens for r in results) < sum(r.stats.draft_tokens for r in results)


# ---------------------------------------------------------------- the real default model (Q4_1 + a Q8_0 head)


@pytest.mark.slow
def test_the_default_model_at_int4_keeps_its_file_in_under_100_mb_and_speculation_stays_exact():
    dec = load_decoder("default", "suffix", weights="int4")
    model = dec.target
    assert model.spec_batch_quant_report.counts == {"Q4_1 as shipped": 210, "Q8_0 as shipped": 1}
    weight_bytes = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    assert weight_bytes <= 100e6, weight_bytes  # 536 MB in fp32
    plain = load_decoder("default", "none", weights="int4")
    assert plain.target is model  # one loaded model per (file, precision)
    _speculation_equals_plain_decoding(dec, plain)


@pytest.mark.slow
def test_the_default_model_in_bfloat16_speculates_exactly_at_batch_1_and_4():
    """Full bf16, the fastest precision with speculation on CPUs with AVX512-BF16 or AMX (docs/weights.md): before
    attention computed in float64 its near-ties flipped between batch shapes (this fails without it)."""
    _speculation_equals_plain_decoding(
        load_decoder("default", "suffix", dtype="bfloat16"), load_decoder("default", "none", dtype="bfloat16")
    )


def _speculation_equals_plain_decoding(dec, plain) -> None:
    """Bit for bit (loading/cpu_attention.py), at batch 1 and 4; before attention computed in float64, most of these
    outputs differed at int4."""
    prompts = [
        dec.apply_chat_template([{"role": "user", "content": p}])
        for p in (
            "Rewrite this sentence, changing only 'cat' to 'dog': The cat sat on the mat and the cat looked at the cat.",
            "What is the capital of France?",
            "Fix the typos and keep everything else: Teh quick brown fox jumsp over the lazzy dog, then it sleeps.",
            "Write two sentences about the sea.",
        )
    ]
    params = SamplingParams(max_new_tokens=40)
    want = [r.token_ids for r in plain.generate(prompts, params, batch_size=1)]
    for batch_size in (1, 4):
        assert [r.token_ids for r in dec.generate(prompts, params, batch_size=batch_size)] == want
    assert [r.token_ids for r in plain.generate(prompts, params, batch_size=4)] == want  # batch 1 is `want` itself


def test_w4a8_runs_the_files_q4_blocks_as_they_ship_and_needs_the_native_kernels(q_gguf, q_cache, monkeypatch):
    if not native_ops():
        pytest.skip("no C++ compiler: the native kernels cannot be built here")
    loaded = load_model(q_gguf, weights="w4a8", cache_dir=q_cache)
    assert loaded.model.spec_batch_quant_report.counts == {"Q4_1 as shipped": 14, "Q8_0 as shipped": 1}
    assert any(isinstance(m, BlockLinear) for m in loaded.model.modules())
    full = load_model(q_gguf, weights="full", cache_dir=q_cache).model
    ids = torch.tensor([[1, 5, 9, 200, 7]])
    with torch.inference_mode():
        got, want = loaded.model(ids).logits.float(), full(ids).logits
    assert (got - want).abs().max() < 0.05 * want.abs().max()
    monkeypatch.setenv("SPEC_BATCH_COMPILE", "off")
    with pytest.raises(InvalidParameterError, match="w4a8.*native CPU kernels.*SPEC_BATCH_COMPILE=off"):
        load_model(q_gguf, weights="w4a8", cache_dir=q_cache)
