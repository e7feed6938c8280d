"""A model's weights moved onto transparent huge pages (loading/huge_pages.py): the same values and the same
logits, parameters keep their identity and tied weights stay tied, the mapping is advised for huge pages, and
nothing moves where the kernel has them off."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from spec_batch.loading import huge_pages
from spec_batch.loading.huge_pages import huge_pages_available, move_to_huge_pages

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="no transparent huge pages on this machine")


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=512,
        vocab_size=4096,  # 4 MB of embeddings: a mapping under a huge page's 2 MB could hold none
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    model.model.register_buffer("table", torch.arange(40_000, dtype=torch.float32))  # a buffer moves too
    return model


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds `address`."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@needs_thp
def test_weights_move_into_one_advised_mapping_with_the_same_values_and_logits():
    model = _model()
    ids = torch.tensor([[1, 5, 9, 300, 7]])
    with torch.no_grad():
        before = model(ids).logits
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    old_ptrs = {name: p.data_ptr() for name, p in params.items()}

    moved = move_to_huge_pages(model)

    assert moved >= sum(p.numel() * 4 for p in params.values() if p.numel() * 4 >= huge_pages._MIN_BYTES)
    assert dict(model.named_parameters()) == params  # the same Parameter objects
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for name, p in params.items():
        assert torch.equal(p, values[name]), name
    big = [name for name, p in params.items() if p.numel() * p.element_size() >= huge_pages._MIN_BYTES]
    assert big and all(params[name].data_ptr() != old_ptrs[name] for name in big)
    assert torch.equal(model.model.table, torch.arange(40_000, dtype=torch.float32))
    flags = _mapping_flags(model.model.embed_tokens.weight.data_ptr())
    assert _mapping_flags(model.model.table.data_ptr()) == flags  # one mapping holds them all
    assert flags.get("THPeligible") == "1"  # advised MADV_HUGEPAGE
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_nothing_moves_where_huge_pages_are_off(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "_THP_MODE", mode)
    model = _model()
    ptrs = {name: p.data_ptr() for name, p in model.named_parameters()}
    assert not huge_pages_available()
    assert move_to_huge_pages(model) == 0
    assert {name: p.data_ptr() for name, p in model.named_parameters()} == ptrs
