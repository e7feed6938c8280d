"""Heads from directories on the real default model: `load_decoder("default", "head:/dir")` keeps the output
token for token (batch 1 and 4), drafting in int8 on the CPU unless draft_weights says otherwise, and a head made
for another target is refused with the reason. The int8 drafting copy (`drafting_head`) on a tiny target."""

from __future__ import annotations

import pytest
import torch

from spec_batch import SamplingParams, load_decoder
from spec_batch.core.heads.head import EagleHead, HeadConfig, init_from_target
from spec_batch.errors import IncompatibleModelsError, InvalidParameterError
from spec_batch.loading.heads import drafting_head, head_weights, save_head
from spec_batch.loading.quant_linear import Int8Linear

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
    assert dec.precision.to_dict()["draft_weights"] == "int8"  # auto on the CPU
    assert load_decoder("default", f"head:{path}", draft_weights="full").precision.to_dict()["draft_weights"] == "full"
    with pytest.raises(InvalidParameterError, match="int4"):
        load_decoder("default", f"head:{path}", draft_weights="int4")
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


def test_head_weights_resolve_per_device():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [head_weights(w, cpu) for w in (None, "auto", "AUTO", "full", "int8")] == [
        "int8",
        "int8",
        "int8",
        "full",
        "int8",
    ]
    assert head_weights(None, cuda) == "full" and head_weights("int8", cuda) == "int8"
    with pytest.raises(InvalidParameterError, match="full or int8"):
        head_weights("int4", cpu)
    with pytest.raises(InvalidParameterError, match="not supported"):
        head_weights("int3", cpu)


@pytest.mark.parametrize("shared", [True, False], ids=["target-rows", "own-lm-head"])
def test_the_int8_drafting_copy_leaves_the_head_and_stays_close(tiny_target, shared):
    """Every linear layer of the copy, its LM head (the target's rows of the draft vocabulary, or its own) too, is
    int8; the caller's head is untouched (still float, same weights, no int8 module); the copy's logits and
    predicted features stay within int8 rounding of the float head's."""
    torch.manual_seed(3)
    d2t = torch.arange(0, 64, 2)
    config = HeadConfig.for_target(tiny_target.config, len(d2t), "tiny")
    config.shared_lm_head = shared
    head = EagleHead(config, tiny_target.get_input_embeddings())
    init_from_target(head, tiny_target, d2t)
    head.eval()
    before = {k: v.clone() for k, v in head.state_dict().items()}
    assert drafting_head(head, "full") is head
    copy = drafting_head(head, "int8")
    linears = [m for m in copy.modules() if isinstance(m, (torch.nn.Linear, Int8Linear))]
    assert linears and all(isinstance(m, Int8Linear) for m in linears) and isinstance(copy.lm_head, Int8Linear)
    assert not any(isinstance(m, Int8Linear) for m in head.modules())
    assert all(torch.equal(v, before[k]) for k, v in head.state_dict().items())
    assert copy.dtype == head.dtype == torch.float32
    ids = torch.randint(0, 64, (2, 7))
    states = torch.randn(2, 7, config.hidden_size)
    with torch.inference_mode():
        want, got = head(ids, states), copy(ids, states)
    for a, b in ((got.logits, want.logits), (got.features, want.features)):
        assert a.dtype == torch.float32
        assert float((a - b).norm() / b.norm()) < 0.03  # int8 weights, bf16 activations
    assert (got.logits.argmax(-1) == want.logits.argmax(-1)).float().mean() >= 0.85
