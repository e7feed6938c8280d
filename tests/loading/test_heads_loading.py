"""Heads from directories on the real default model: `load_decoder("default", "head:/dir")` keeps the output
token for token (batch 1 and 4), and a head made for another target is refused with the reason."""
from __future__ import annotations

import pytest
import torch

from spec_batch import SamplingParams, load_decoder
from spec_batch.core.head import EagleHead, HeadConfig, init_from_target
from spec_batch.errors import IncompatibleModelsError
from spec_batch.loading.heads import save_head

PROMPTS = ["Write one sentence about the sea.", "List three colors, one per line.", "What is 2 + 2?"]


@pytest.mark.slow
def test_a_head_directory_drafts_for_the_default_model(default_decoder, hf_greedy, tmp_path):
    target = default_decoder.target
    torch.manual_seed(0)
    d2t = torch.arange(0, 4096)
    head = EagleHead(HeadConfig.for_target(target.config, len(d2t), default_decoder.target_name))
    init_from_target(head, target, d2t)
    path = save_head(head, tmp_path / "head")
    assert sum(f.stat().st_size for f in path.iterdir()) < 40e6  # no embedding, no 49k-row LM head
    dec = load_decoder("default", f"head:{path}", adaptive=False, num_draft_tokens=4)
    assert dec.draft_name == "head:head"
    prompts = [dec.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    refs = [hf_greedy(target, p, 24, eos_token_id=sorted(dec.eos_ids)[0]) for p in prompts]
    for batch_size in (1, 4):
        results = dec.generate(prompts, SamplingParams(max_new_tokens=24), batch_size=batch_size)
        assert [r.token_ids for r in results] == refs
        assert sum(r.stats.draft_tokens for r in results) > 0


@pytest.mark.slow
def test_a_head_for_another_target_is_refused(default_decoder, tiny_target, tmp_path):
    head = EagleHead(HeadConfig.for_target(tiny_target.config, 16, "tiny"))
    with pytest.raises(IncompatibleModelsError, match="hidden size 32"):
        load_decoder("default", f"head:{save_head(head, tmp_path / 'tiny')}")
    t = default_decoder.target.config
    renamed = EagleHead(HeadConfig.for_target(t, 16, "someone/else"))
    with pytest.raises(IncompatibleModelsError, match="trained on another target"):
        load_decoder("default", f"head:{save_head(renamed, tmp_path / 'other')}")
    with pytest.raises(Exception, match="no config.json"):
        load_decoder("default", f"head:{tmp_path}")
