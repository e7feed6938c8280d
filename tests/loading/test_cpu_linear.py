"""Prepacked oneDNN linear layers: the same numbers as nn.Linear (up to rounding), the same greedy tokens, only
for models this package loads, and off with SPEC_BATCH_PACK_WEIGHTS=0."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from spec_batch.core.kv import padding
from spec_batch.core.params import SamplingParams
from spec_batch.loading import build_decoder, cpu_linear
from spec_batch.loading.cpu_linear import PackedLinear, pack_linear_weights

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear")


def _linears(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if type(m) is nn.Linear)


def test_packed_model_computes_the_same_logits_and_greedy_tokens(tiny_llama, hf_greedy):
    plain = tiny_llama(11, vocab=64, layers=2, lm_head_scale=4.0)
    packed = copy.deepcopy(plain)
    n_linear = _linears(plain)
    assert pack_linear_weights(packed) == n_linear > 0
    assert _linears(packed) == 0
    ids = torch.tensor([[3, 9, 27, 5, 1, 44, 8]])
    with torch.inference_mode():
        want, got = plain(ids).logits, packed(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    prompt = [3, 9, 27, 5]
    assert hf_greedy(packed, prompt, 24) == hf_greedy(plain, prompt, 24)


def test_only_the_output_embeddings_keep_a_plain_weight(tiny_llama):
    model = copy.deepcopy(tiny_llama(12))
    pack_linear_weights(model)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    kept = [m for m in packed if m.weight is not None]
    assert kept == [model.get_output_embeddings()]
    assert model.get_output_embeddings().weight.shape == (64, 32)  # the vocabulary size stays readable


def test_bfloat16_layers_pack_too(tiny_llama):
    plain = copy.deepcopy(tiny_llama(13)).to(torch.bfloat16)
    packed = copy.deepcopy(plain)
    if pack_linear_weights(packed) == 0:
        pytest.skip("this oneDNN build has no bf16 linear on this CPU")
    x = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(packed(x).logits.float(), plain(x).logits.float(), rtol=5e-2, atol=5e-2)


def test_switched_off_by_the_environment(tiny_dir, monkeypatch):
    from spec_batch.loading.load import load_model

    monkeypatch.setenv("SPEC_BATCH_PACK_WEIGHTS", "0")
    loaded = load_model(str(tiny_dir))
    assert _linears(loaded.model) > 0
    assert not any(isinstance(m, PackedLinear) for m in loaded.model.modules())


def test_float16_and_non_cpu_layers_are_left_alone(tiny_llama):
    model = copy.deepcopy(tiny_llama(15)).to(torch.float16)
    assert pack_linear_weights(model) == 0


def test_a_disagreeing_kernel_leaves_the_model_unpacked(tiny_llama, monkeypatch):
    model = copy.deepcopy(tiny_llama(16))
    monkeypatch.setattr(cpu_linear, "_same_results", lambda packed, linear: False)
    assert pack_linear_weights(model) == 0
    assert _linears(model) == _linears(tiny_llama(16))


def test_models_passed_in_are_not_packed_but_loaded_ones_are(tiny_dir, tiny_target, fake_tokenizer):
    from spec_batch.loading import load_decoder
    from spec_batch.loading.load import load_model

    before = _linears(tiny_target)
    load_decoder(tiny_target, "none", tokenizer=fake_tokenizer)
    assert _linears(tiny_target) == before  # the caller's model is the caller's
    loaded = load_model(str(tiny_dir))
    assert _linears(loaded.model) == 0
    assert any(isinstance(m, PackedLinear) for m in loaded.model.modules())


def test_a_packed_model_can_be_deep_copied(tiny_llama):
    """Bench and users copy a target to use it as its own draft; oneDNN's blocked tensors do not copy as they are."""
    packed = copy.deepcopy(tiny_llama(17))
    pack_linear_weights(packed)
    twin = copy.deepcopy(packed)
    assert twin.get_output_embeddings().weight is not packed.get_output_embeddings().weight
    x = torch.tensor([[5, 6, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(twin(x).logits, packed(x).logits, rtol=0, atol=0)


def test_packed_layers_compute_only_the_real_positions(tiny_llama):
    """Inside a forward that published its real positions, the real positions get the dense forward's logits
    and the padded ones zeros (nothing reads them: they are masked out of attention and never verified)."""
    packed = copy.deepcopy(tiny_llama(15, vocab=64, layers=2, lm_head_scale=4.0))
    pack_linear_weights(packed)
    ids = torch.tensor([[3, 9, 27, 5], [4, 8, 1, 1], [7, 1, 1, 1]])
    valid = torch.tensor([[True] * 4, [True, True, False, False], [True, False, False, False]])
    with torch.inference_mode():
        dense = packed(ids).logits
        with padding.real_positions(valid):
            ragged = packed(ids).logits
    torch.testing.assert_close(ragged[valid], dense[valid], rtol=1e-5, atol=1e-6)
    assert torch.equal(ragged[valid].argmax(-1), dense[valid].argmax(-1))
    assert bool((ragged[~valid] == 0).all())


@pytest.mark.parametrize("drafter", ["suffix", "ngram"])
def test_decoder_on_a_packed_target_plans_per_row_and_stays_greedy_exact(
    drafter, tiny_llama, hf_greedy, fake_tokenizer
):
    """A packed target skips padding, so the policy plans each row's own length (rows of a batch draft different
    lengths); every row's output is still the target's own greedy output."""
    target = copy.deepcopy(tiny_llama(16, vocab=64, layers=2, lm_head_scale=4.0))
    pack_linear_weights(target)
    dec = build_decoder(target, fake_tokenizer, target_name="tiny-packed", draft=drafter, device=torch.device("cpu"))
    assert dec.policy.ragged
    prompts = [[3, 9, 27, 5, 3, 9, 27, 5, 3, 9], [4, 8, 15, 16, 23, 42, 4, 8], [7, 1, 2], [11, 12, 11, 12, 11]]
    results = dec.generate(prompts, SamplingParams(max_new_tokens=24), batch_size=4)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 24) for p in prompts]
    assert not build_decoder(
        tiny_llama(16, vocab=64, layers=2, lm_head_scale=4.0),
        fake_tokenizer,
        target_name="tiny",
        draft=drafter,
        device=torch.device("cpu"),
    ).policy.ragged


def test_a_rows_result_does_not_depend_on_how_many_rows_are_computed():
    """Fewer than MIN_ROWS rows get zero rows added (oneDNN's one- and two-row kernels are slower and round
    differently): a token's numbers are then the same bit for bit at batch 1 and batch 8."""
    torch.manual_seed(0)
    layer = PackedLinear(nn.Linear(1536, 576, bias=False), keep_weight=False)  # the default model's down_proj
    x = torch.randn(8, 1536)
    with torch.inference_mode():
        full = layer(x)
        for n in range(1, 8):
            assert torch.equal(layer(x[:n]), full[:n]), n
        assert torch.equal(layer(x[:1].view(1, 1, 1536)), full[:1].view(1, 1, 576))  # any leading dims
