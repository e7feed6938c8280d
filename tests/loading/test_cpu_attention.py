"""`spec_batch_sdpa`: grouped-query attention on the CPU without copying the cache, what `sdpa` computes up to
rounding, used for the masked multi-token forwards of verify steps."""

from __future__ import annotations

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_batch.core.kv.kv_batch import KVBatch, left_padded
from spec_batch.loading import cpu_attention
from spec_batch.loading.cpu_attention import NAME, use_gqa_attention

CPU = torch.device("cpu")


def _gqa_llama(attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(3)
    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=64,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config).eval()


def _verify_step_logits(model: LlamaForCausalLM) -> torch.Tensor:
    """A prefill of two ragged rows, a rollback (a hole in the mask), then a 4-token step: what a verify does."""
    kv = KVBatch(model, CPU, 2)
    ids, valid = left_padded([[5, 9, 11, 3, 7, 1], [8, 2, 6]], 0, CPU)
    with torch.inference_mode():
        kv.forward(ids, valid)
        kv.rollback(torch.tensor([2, 0]))
        step = torch.tensor([[4, 12, 13, 14], [15, 16, 0, 0]])
        return kv.forward(step, step != 0)


def test_the_same_logits_without_copying_the_cache(monkeypatch):
    plain = _gqa_llama()
    fast = copy.deepcopy(plain)
    assert use_gqa_attention(fast) and fast.config._attn_implementation == NAME
    fallbacks: list[int] = []
    original = cpu_attention.sdpa_attention_forward

    def counting(module, query, *args, **kwargs):
        fallbacks.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(cpu_attention, "sdpa_attention_forward", counting)
    want, got = _verify_step_logits(plain), _verify_step_logits(fast)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert fallbacks == []  # every forward here had several tokens and a mask: none fell back to `sdpa`


def test_single_token_steps_keep_huggingface_sdpa(monkeypatch):
    model = _gqa_llama()
    use_gqa_attention(model)
    seen: list[int] = []
    original = cpu_attention.sdpa_attention_forward
    monkeypatch.setattr(
        cpu_attention,
        "sdpa_attention_forward",
        lambda module, query, *a, **k: seen.append(query.shape[2]) or original(module, query, *a, **k),
    )
    kv = KVBatch(model, CPU, 1)
    with torch.inference_mode():
        kv.forward(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.bool))
        kv.forward(torch.tensor([[4]]), torch.ones(1, 1, dtype=torch.bool))
    assert seen and seen[-1] == 1


def test_other_attention_implementations_are_left_alone():
    model = _gqa_llama("eager")
    assert not use_gqa_attention(model)
    assert model.config._attn_implementation == "eager"


def test_a_model_that_refuses_the_switch_loads_as_it_is(monkeypatch):
    model = _gqa_llama()

    def refuse(name: str) -> None:
        raise ValueError(f"{name} is not supported by this model class")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    assert not use_gqa_attention(model)
    assert model.config._attn_implementation == "sdpa"


def test_folded_query_heads_attend_as_repeated_key_value_heads():
    """Stacking the query heads of each key/value head as its queries is grouped-query attention, for per-row masks
    and for one mask shared by every row."""
    gen = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, n, 8, generator=gen) for h, n in ((6, 3), (2, 7), (2, 7)))
    for mask in (torch.rand(2, 1, 3, 7, generator=gen) > 0.3, torch.rand(1, 1, 3, 7, generator=gen) > 0.3):
        mask[..., 0] = True  # every query sees something
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(3, dim=1), value.repeat_interleave(3, dim=1), attn_mask=mask
        )
        got = cpu_attention._folded(query, key, value, mask, None, 0.0)
        assert got.shape == (2, 3, 6, 8)
        torch.testing.assert_close(got, want.transpose(1, 2), rtol=1e-5, atol=1e-6)
