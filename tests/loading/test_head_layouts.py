"""Published head layouts read as they ship: an EAGLE-1 head (vLLM's / SGLang's keys and config) saved from random
weights computes what an independent implementation (transformers' own Llama layer, no input norm, the target's
LM head) computes, and drafts exactly; an EAGLE-3 head is refused with the reason."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from spec_batch import SamplingParams
from spec_batch.core.head import EagleHead, HeadConfig
from spec_batch.errors import InvalidParameterError
from spec_batch.loading import build_decoder
from spec_batch.loading.head_layouts import save_eagle1
from spec_batch.loading.heads import load_head

CPU = torch.device("cpu")


@pytest.fixture
def eagle1_dir(tiny_target, tmp_path):
    torch.manual_seed(4)
    config = HeadConfig.for_target(tiny_target.config, 64, "")
    config.input_norm, config.shared_lm_head = False, True
    head = EagleHead(config, tiny_target.get_input_embeddings())
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return save_eagle1(head, tmp_path / "eagle1")


def _reference(tiny_target, path, ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """EAGLE-1 from its published description, on transformers' Llama layer: fc(cat(embedding, state)), one
    layer without input norm, the target's LM head."""
    from safetensors.torch import load_file

    raw = json.loads((path / "config.json").read_text())
    cfg = LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type", "bias")})
    cfg._attn_implementation = "sdpa"
    w = load_file(str(path / "model.safetensors"))
    layer = LlamaDecoderLayer(cfg, 0)
    layer.load_state_dict({k[len("layers.0."):]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=False)
    layer.input_layernorm = torch.nn.Identity()
    x = torch.cat([tiny_target.get_input_embeddings()(ids), states], dim=-1) @ w["fc.weight"].T + w["fc.bias"]
    pos = torch.arange(ids.shape[1]).unsqueeze(0)
    out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=LlamaRotaryEmbedding(cfg)(x, pos))
    out = out[0] if isinstance(out, tuple) else out
    return tiny_target.lm_head(out)


def test_an_eagle1_head_computes_what_its_layout_says(tiny_target, eagle1_dir):
    head = load_head(eagle1_dir).attach(tiny_target.get_input_embeddings(), tiny_target.get_output_embeddings())
    assert head.config.shared_lm_head and not head.config.input_norm and head.lm_head is None
    ids = torch.tensor([[3, 9, 4, 1, 7, 7, 2]])
    with torch.inference_mode():
        states = tiny_target(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        torch.testing.assert_close(head(ids, states).logits, _reference(tiny_target, eagle1_dir, ids, states))


@pytest.mark.parametrize("batch_size", [1, 8])
def test_an_eagle1_head_drafts_exactly(tiny_target, fake_tokenizer, eagle1_dir, hf_greedy, batch_size):
    dec = build_decoder(tiny_target, fake_tokenizer, target_name="tiny", draft=load_head(eagle1_dir), device=CPU,
                        num_draft_tokens=4, adaptive=False)
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3], [10, 20, 30, 40, 10, 20]]
    results = dec.generate(prompts, SamplingParams(max_new_tokens=16), batch_size=batch_size)
    assert [r.token_ids for r in results] == [hf_greedy(tiny_target, p, 16) for p in prompts]
    assert sum(r.stats.draft_tokens for r in results) > 0


def test_an_eagle3_head_is_refused_with_the_reason(tiny_target, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "eagle3"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 32,
                                                  "draft_vocab_size": 16, "vocab_size": 64}))
    save_file({"midlayer.self_attn.q_proj.weight": torch.zeros(32, 64), "d2t": torch.zeros(16, dtype=torch.long),
               "fc.weight": torch.zeros(32, 96)}, str(path / "model.safetensors"))
    with pytest.raises(InvalidParameterError, match="EAGLE-3"):
        load_head(path)
