"""Our Llama-family forward (loading/llama_forward.py) gives Hugging Face's logits bit for bit: ragged prefills,
verify steps after a rollback, draft trees, at every weight storage and compute dtype with native attention; it
is what a default load decodes with, and the switch refuses what it cannot do."""

from __future__ import annotations

import pytest
import torch

from spec_batch.core.heads.hidden import capture_hidden
from spec_batch.core.kv.kv_batch import KVBatch, left_padded
from spec_batch.loading.kernels import native_ops
from spec_batch.loading.llama_forward import forward_kind, use_own_forward, why_not

CPU = torch.device("cpu")
PROMPTS = [[5, 9, 11, 3, 7, 1, 30, 2, 17], [8, 2, 6], [40, 41]]

needs_kernels = pytest.mark.skipif(not native_ops(), reason="no C++ compiler: the native kernels cannot be built")


def _real(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The logits of the real positions, zeros at the padded ones: nothing reads those, and a padded query attends
    to nothing in our forward (llama_forward._visible) where Hugging Face's mask lets it see its row's context;
    the two differ there unless the linears skip padding (computing zeros at it)."""
    return torch.where(valid.unsqueeze(-1), logits, torch.zeros((), dtype=logits.dtype))


def _steps(model, own: bool) -> list[torch.Tensor]:
    """A ragged prefill, a verify step, a rollback, a draft tree and a step after keeping one path."""
    forward = model.spec_batch_forward
    model.spec_batch_forward = forward if own else None
    try:
        kv = KVBatch(model, CPU, len(PROMPTS))
        ids, valid = left_padded(PROMPTS, 0, CPU)
        out = [_real(kv.forward(ids, valid), valid)]
        step = torch.tensor([[50, 51, 52], [53, 0, 0], [54, 55, 0]])
        out.append(_real(kv.forward(step, step != 0), step != 0))
        kv.rollback(torch.tensor([2, 0, 1]))
        # a tree: node 0 the root, nodes 1 and 2 its children (depth 1), node 3 child of 1 (depth 2)
        attend = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
        attend = attend.expand(len(PROMPTS), -1, -1)
        tree = torch.tensor([[20, 21, 22, 23]] * len(PROMPTS))
        depth = torch.tensor([0, 1, 1, 2])
        positions = kv.next_pos.unsqueeze(1) + depth
        out.append(kv.forward_tree(tree, torch.ones_like(tree, dtype=torch.bool), positions, attend).logits)
        kv.keep_last(torch.tensor([[True, True, False, True]] * len(PROMPTS)))
        out.append(kv.forward(torch.tensor([[9], [9], [9]]), torch.ones(3, 1, dtype=torch.bool), logits_to_keep=1))
        return out
    finally:
        model.spec_batch_forward = forward


@needs_kernels
@pytest.mark.parametrize(
    "weights,dtype",
    [("full", torch.float32), ("full", torch.bfloat16), ("int4", torch.float32), ("int8", torch.float32)]
    + [("w4a8", torch.float32), ("w4a8", torch.bfloat16)],
)
def test_our_forward_gives_hugging_faces_logits_bit_for_bit(weights, dtype, prepared_llama):
    model = prepared_llama(weights, dtype, True, seed=11, layers=3)
    assert use_own_forward(model, "auto") == "own" and forward_kind(model) == "own"
    forward = model.spec_batch_forward
    stacked = []  # the steps that ran the whole stack in one native call (decoder_layers)
    if weights == "w4a8":  # every layer runs the native layer steps (layer_glue.cpp) where its rows are float32
        assert all(part.native is not None for part in forward.parts) and forward.stack is not None
        whole = forward._stack
        forward._stack = lambda *args: stacked.append(args[4]) or whole(*args)
    with torch.inference_mode():
        ours, theirs = _steps(model, own=True), _steps(model, own=False)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a.shape == b.shape and torch.equal(a, b), (i, (a.float() - b.float()).abs().max())
    # the verify step, the tree and the step after it are decode steps: float32 rows run them in one native call
    assert stacked == ([3, 4, 1] if (weights, dtype) == ("w4a8", torch.float32) else [])


@needs_kernels
def test_the_final_norms_hook_still_sees_the_hidden_states_and_layer_hooks_use_hugging_faces_forward(prepared_llama):
    model = prepared_llama("full", torch.float32, True, seed=11, layers=3)
    use_own_forward(model, "own")
    own, calls = model.spec_batch_forward, []

    class Counting:
        def usable(self, model_kwargs):
            return own.usable(model_kwargs)

        def __call__(self, **kwargs):
            calls.append(1)
            return own(**kwargs)

    model.spec_batch_forward = Counting()
    with torch.inference_mode():
        kv = KVBatch(model, CPU, 1)
        ids, valid = left_padded(PROMPTS[:1], 0, CPU)
        with capture_hidden(model, True) as last:
            kv.forward(ids, valid)
        assert len(calls) == 1 and len(last) == 1 and last[0].shape == (1, len(PROMPTS[0]), 64)
        with capture_hidden(model, True, layers=[0, 2]) as features:  # hooks on the embeddings and a layer
            kv.forward(torch.tensor([[3]]), torch.ones(1, 1, dtype=torch.bool))
        assert len(calls) == 1 and features[0].shape == (1, 1, 128)  # Hugging Face's forward ran that one


def test_the_switch_refuses_what_it_cannot_do(prepared_llama):
    model = prepared_llama(
        "full", torch.float32, False, seed=11, layers=3
    )  # float64 attention: ours needs the native kernel
    assert "attention" in why_not(model)
    assert use_own_forward(model, "auto") == "hf" and forward_kind(model) == "hf"
    with pytest.raises(ValueError, match="SPEC_BATCH_FORWARD=own"):
        use_own_forward(model, "own")
    with pytest.raises(ValueError, match="sometimes"):
        use_own_forward(model, "sometimes")
    if native_ops():
        native = prepared_llama("full", torch.float32, True, seed=11, layers=3)
        assert use_own_forward(native, "hf") == "hf" and forward_kind(native) == "hf"


def test_the_setting_names_its_choices(monkeypatch):
    from spec_batch.settings import SettingsError, get_settings

    monkeypatch.setenv("SPEC_BATCH_FORWARD", "own")
    assert get_settings().forward == "own"
    monkeypatch.setenv("SPEC_BATCH_FORWARD", "fast")
    with pytest.raises(SettingsError, match="SPEC_BATCH_FORWARD='fast' is not one of auto, own, hf"):
        get_settings()


@needs_kernels
def test_the_default_model_decodes_with_our_forward_and_the_same_logits(default_decoder):
    model = default_decoder.target
    assert forward_kind(model) == "own"
    with torch.inference_mode():
        ours, theirs = _steps(model, own=True), _steps(model, own=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
