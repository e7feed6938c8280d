"""The patches laid on transformers are on, on the default model loaded by name on the CPU. A transformers release
that turns one off silently (outputs stay right, only slower, or the cache falls back to its own layers) fails
here: pyproject.toml pins the minor version this passed on, and core/kv/hf_compat.py and loading/compat.py are the
only modules that reach into transformers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from spec_batch.core.kv.hf_compat import LAYER_OVERRIDES, DynamicLayer
from spec_batch.core.kv.kv_batch import KVBatch, SlabLayer, left_padded
from spec_batch.loading.cpu_attention import NATIVE_DTYPES, attention_kind
from spec_batch.loading.fused_projections import FusedGroup
from spec_batch.loading.kernels import native_ops
from spec_batch.settings import get_settings

CPU = torch.device("cpu")


def test_slab_layer_overrides_methods_the_cache_layer_still_has():
    for name in LAYER_OVERRIDES:
        assert callable(getattr(DynamicLayer, name, None)), f"transformers' DynamicLayer has no {name} now"
        assert name in SlabLayer.__dict__


@pytest.mark.slow
def test_the_default_model_runs_its_attention_kv_layers_and_fused_groups(default_decoder):
    model = default_decoder.target
    native = native_ops(get_settings().compile) and model.dtype in NATIVE_DTYPES
    assert attention_kind(model) == ("native" if native else "float64")

    layers = model.config.num_hidden_layers
    groups = [m for m in model.modules() if isinstance(m, FusedGroup)]
    assert len(groups) == 2 * layers  # q/k/v and gate/up in every layer
    calls: Counter[int] = Counter()
    hooks = [g.fused.register_forward_hook(lambda *_, i=i: calls.update([i])) for i, g in enumerate(groups)]
    try:
        kv = KVBatch(model, CPU, 2)
        ids, valid = left_padded([[1, 2, 3, 4, 5], [6, 7, 8]], 0, CPU)
        with torch.inference_mode():
            kv.forward(ids, valid)  # a prefill
            kv.forward(torch.tensor([[9, 10, 11], [12, 13, 14]]), torch.ones(2, 3, dtype=torch.bool))  # a verify step
    finally:
        for hook in hooks:
            hook.remove()
    # one call per group per forward: a part that recomputed its group (HF stopped passing one tensor) shows here
    assert calls == Counter({i: 2 for i in range(len(groups))})
    assert len(kv.cache.layers) == layers and all(type(layer) is SlabLayer for layer in kv.cache.layers)
