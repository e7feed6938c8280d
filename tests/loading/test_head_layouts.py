"""Published head layouts read as they ship, from random heads saved in each layout: an EAGLE-1 head (vLLM's /
SGLang's keys and config) computes what transformers' own Llama layer computes (no input norm, the target's LM
head); an EAGLE-3 head (midlayer.*, fc over three target layers, d2t offsets) computes what vLLM's description
says, on the target layers the decoder captures; both draft exactly at batch 1 and 8."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from spec_batch import SamplingParams
from spec_batch.core.heads.head import EagleHead, HeadConfig
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
    layer.load_state_dict({k[len("layers.0.") :]: v for k, v in w.items() if k.startswith("layers.0.")}, strict=False)
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
    check_exact(tiny_target, load_head(eagle1_dir), fake_tokenizer, hf_greedy, batch_size)


def check_exact(target, head, tokenizer, hf_greedy, batch_size: int) -> None:
    """Greedy decoding with the head drafting 4 tokens a step equals Hugging Face's greedy output."""
    dec = build_decoder(
        target, tokenizer, target_name="tiny", draft=head, device=CPU, num_draft_tokens=4, adaptive=False
    )
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3], [7, 8, 9], [3], [10, 20, 30, 40, 10, 20]]
    results = dec.generate(prompts, SamplingParams(max_new_tokens=16), batch_size=batch_size)
    assert [r.token_ids for r in results] == [hf_greedy(target, p, 16) for p in prompts]
    assert sum(r.stats.draft_tokens for r in results) > 0


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def save_eagle3(path, target, draft_vocab: int, layer_ids: list[int] | None, seed: int = 0):
    """A random head in EAGLE-3's published layout (SpecForge / vLLM keys), for a target of hidden size 32."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    h, heads, kv, hd, inter = 32, 2, 1, 16, 64
    rnd = lambda *shape: torch.randn(*shape, generator=g) * 0.2
    w = {
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "midlayer.input_layernorm.weight": 1 + rnd(h),
        "midlayer.hidden_norm.weight": 1 + rnd(h),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(h),
        "norm.weight": 1 + rnd(h),
        "fc.weight": rnd(h, 3 * h),
        "lm_head.weight": rnd(draft_vocab, h) * 10,
        "embed_tokens.weight": target.get_input_embeddings().weight.detach().clone(),
    }
    vocab = target.get_output_embeddings().weight.shape[0]
    targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    w["d2t"] = targets - torch.arange(draft_vocab)  # offsets, as published
    w["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
    }
    if layer_ids is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": layer_ids, "use_aux_hidden_state": True}
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file(w, str(path / "model.safetensors"))
    return path, w, config


def _eagle3_reference(target, w, cfg_dict, ids, aux) -> torch.Tensor:
    """EAGLE-3 from vLLM's description, with transformers' RoPE: full-vocabulary logits at every position."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    cfg = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, rope_theta=10000.0)
    n = ids.shape[1]
    state = aux @ w["fc.weight"].T
    x = torch.cat(
        [
            _rms(target.get_input_embeddings()(ids), w["midlayer.input_layernorm.weight"]),
            _rms(state, w["midlayer.hidden_norm.weight"]),
        ],
        dim=-1,
    )
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(1, n, 2, 16).transpose(1, 2)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(1, n, 1, 16).transpose(1, 2)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(1, n, 1, 16).transpose(1, 2)
    pos = torch.arange(n).unsqueeze(0)
    q, k = apply_rotary_pos_emb(q, k, *LlamaRotaryEmbedding(cfg)(x, pos))
    attn = torch.nn.functional.scaled_dot_product_attention(q, repeat_kv(k, 2), repeat_kv(v, 2), is_causal=True)
    residual = state + attn.transpose(1, 2).reshape(1, n, 32) @ w["midlayer.self_attn.o_proj.weight"].T
    y = _rms(residual, w["midlayer.post_attention_layernorm.weight"])
    mlp = torch.nn.functional.silu(y @ w["midlayer.mlp.gate_proj.weight"].T) * (y @ w["midlayer.mlp.up_proj.weight"].T)
    out = residual + mlp @ w["midlayer.mlp.down_proj.weight"].T
    draft_logits = _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    full = torch.full((1, n, cfg_dict["vocab_size"]), float("-inf"))
    full[..., torch.arange(cfg_dict["draft_vocab_size"]) + w["d2t"]] = draft_logits
    return full


@pytest.mark.parametrize("layer_ids,hf_layers", [(None, [2, 2, 1]), ([0, 1, 2], [1, 2, 3])])
def test_an_eagle3_head_computes_what_its_layout_says(tiny_llama, tmp_path, layer_ids, hf_layers):
    from spec_batch.core.heads.hidden import capture_hidden
    from spec_batch.loading.heads import head_factory

    target = tiny_llama(1, vocab=64, layers=4)
    path, w, cfg = save_eagle3(tmp_path / "e3", target, 40, layer_ids)
    head = load_head(path)
    head_factory(head, target, "tiny", None, CPU, 0)  # checks, attaches, fills in the default target layers
    assert head.config.layout == "eagle3" and head.config.target_layers == hf_layers
    ids = torch.tensor([[3, 9, 4, 1, 7, 7, 2, 5]])
    with torch.inference_mode(), capture_hidden(target, True, hf_layers) as captured:
        hs = target(input_ids=ids, output_hidden_states=True).hidden_states
        aux = torch.cat([hs[i] for i in hf_layers], dim=-1)
        torch.testing.assert_close(captured[-1], aux)  # the decoder's capture is these layers' states
        got = head(ids, aux).logits
        want = _eagle3_reference(target, w, cfg, ids, aux)
    full = torch.full_like(want, float("-inf"))
    full[..., head.d2t] = got
    torch.testing.assert_close(full, want)


@pytest.mark.parametrize("batch_size", [1, 8])
def test_an_eagle3_head_drafts_exactly(tiny_llama, fake_tokenizer, tmp_path, hf_greedy, batch_size):
    target = tiny_llama(1, vocab=64, layers=4)
    path, _, _ = save_eagle3(tmp_path / "e3", target, 40, None)
    check_exact(target, load_head(path), fake_tokenizer, hf_greedy, batch_size)


def test_a_layout_that_is_no_eagle_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "other"
    path.mkdir()
    (path / "config.json").write_text(
        json.dumps({"hidden_size": 32, "num_attention_heads": 2, "vocab_size": 64, "intermediate_size": 64})
    )
    save_file({"something.weight": torch.zeros(2, 2)}, str(path / "model.safetensors"))
    with pytest.raises(InvalidParameterError, match="not an EAGLE head"):
        load_head(path)
