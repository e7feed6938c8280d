"""EAGLE-3's training-time test (core/heads/head_train.ttt_passes): pass j must compute exactly what drafting computes at
depth j + 1, where the head's cache holds the real entries up to the chain's start and the chain's own entries,
so that what the head is trained on is what it drafts with."""

from __future__ import annotations

import torch
from torch import nn

from spec_batch.core.heads.head import EagleHead, HeadConfig, eagle3_layers
from spec_batch.core.heads.head_train import TTT_STEPS, _PassCache, _ttt_mask, ttt_passes


def _eagle3_head(seed: int = 0) -> EagleHead:
    torch.manual_seed(seed)
    config = HeadConfig(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=64,
        draft_vocab_size=64,
        layout="eagle3",
        final_norm=True,
        target_layers=[0, 1, 2],
    )
    return EagleHead(config, nn.Embedding(64, 32)).eval()


def test_mask_sees_the_real_prefix_then_the_chain():
    m = _ttt_mask(5, 2, torch.device("cpu"))
    assert m.shape == (5, 15)
    u = 4  # a chain of depth 3 from position 2: real entries 0..2, pass 1's entry at 3, pass 2's at 4
    assert m[u, :5].tolist() == [True, True, True, False, False]
    assert m[u, 5:10].tolist() == [False, False, False, True, False]
    assert m[u, 10:].tolist() == [False, False, False, False, True]
    assert m[0, :5].sum() == 0 and bool(m[0, 10])  # no chain fits: only itself (never an empty row)
    assert _ttt_mask(4, 0, torch.device("cpu")).equal(torch.ones(4, 4).tril().bool())  # pass 0: causal


def test_passes_equal_drafting_through_the_cache():
    head = _eagle3_head()
    n = 9
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, n), generator=gen)
    feats = torch.randn(1, n, 96, generator=gen)
    with torch.no_grad():
        passes = ttt_passes(head, ids, feats)
        assert len(passes) == TTT_STEPS
        for start in range(n - TTT_STEPS + 1):
            cache = _PassCache()
            out = head(ids[:, : start + 1], feats[:, : start + 1], past_key_values=cache)
            torch.testing.assert_close(out.logits[0, start], passes[0].logits[0, start])
            state = out.features[:, -1:]
            for depth in range(1, TTT_STEPS):
                u = start + depth
                out = head(
                    ids[:, u : u + 1],
                    state,
                    attention_mask=torch.ones(1, u + 1, dtype=torch.long),
                    position_ids=torch.tensor([[u]]),
                    past_key_values=cache,
                    raw=False,
                )
                torch.testing.assert_close(out.logits[0, 0], passes[depth].logits[0, u], rtol=1e-4, atol=1e-5)
                state = out.features


def test_default_layers_stay_inside_a_small_target():
    assert eagle3_layers(30) == [2, 15, 27]  # vLLM's and SGLang's choice for a 30-layer target
    assert eagle3_layers(4) == [2, 2, 1]  # their order, which a published head's fc was trained on
    assert eagle3_layers(2) == [2, 1, 0]
