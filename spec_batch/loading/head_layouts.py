"""Published draft heads read as they ship (a directory with config.json and model.safetensors or
pytorch_model.bin), for Llama-family targets.

- EAGLE-1 (SafeAILab/EAGLE; vLLM's `EagleLlamaForCausalLM`, SGLang's `LlamaForCausalLMEagle`): a Llama config
  with one hidden layer; keys `fc.weight` [H, 2H] (`fc.bias` in the original repository's heads), `layers.0.*`
  in Llama's names, an optional `embed_tokens.weight` (the target's, not read). The first layer applies no input
  norm, there is no final norm, and the logits come from the target's own LM head (full vocabulary).
  The fused input is cat(embedding, hidden state), as ours.

- EAGLE-3 (vLLM's `Eagle3LlamaForCausalLM`, SGLang's `LlamaForCausalLMEagle3`, SpecForge's output): keys
  `midlayer.*` (one layer whose q/k/v read 2H: [norm(embedding) ; hidden_norm(state)]), `fc.weight` [H, 3H] over
  three target layers, `norm.weight`, `lm_head.weight` [draft_vocab, H], `d2t` [draft_vocab] as offsets (target id
  = draft id + d2t[id]); `t2d` and `embed_tokens` are not read. The target layers: the config's
  `eagle_config.eagle_aux_hidden_state_layer_ids` (layer outputs: Hugging Face index + 1), else vLLM's and
  SGLang's default, the inputs of layers 2, L/2 and L-3 (filled in against the target, loading/heads.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..core.heads.head import EagleHead, HeadConfig, _rope_theta
from ..errors import InvalidParameterError


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(path / "model.safetensors"))
    if (path / "pytorch_model.bin").is_file():
        return torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise InvalidParameterError(f"draft head {str(path)!r}: no model.safetensors or pytorch_model.bin")


def _strip(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v for k, v in weights.items()}


def is_eagle3(config: dict[str, Any], keys: set[str]) -> bool:
    archs = " ".join(config.get("architectures") or [])
    return "Eagle3" in archs or any(k.startswith("midlayer.") for k in keys) or "d2t" in keys


def load_published(
    path: Path, config: dict[str, Any], device: torch.device | str, dtype: torch.dtype | None
) -> EagleHead:
    """A published EAGLE-1 head as an EagleHead that shares the target's LM head."""
    weights = _strip(_read_weights(path))
    if is_eagle3(config, set(weights)):
        return _eagle3(path, config, weights, device, dtype)
    if "fc.weight" not in weights or not any(k.startswith("layers.0.") for k in weights):
        raise InvalidParameterError(f"draft head {str(path)!r}: not an EAGLE head (no fc.weight / layers.0.*)")
    hidden = int(config["hidden_size"])
    head = EagleHead(_config(config, int(config["vocab_size"]), input_norm=False, shared_lm_head=True))
    state = {k: v for k, v in weights.items() if k.startswith(("fc.", "layers.0."))}
    state.setdefault("fc.bias", torch.zeros(hidden))  # vLLM's layout has none: a zero bias is the same map
    state.setdefault("layers.0.input_layernorm.weight", torch.ones(hidden))  # unused: no input norm on layer 0
    state["d2t"] = head.d2t
    head.load_state_dict(state, strict=True)
    return head.to(device=device, dtype=dtype or torch.float32).eval()


def _config(config: dict[str, Any], draft_vocab: int, **kw: Any) -> HeadConfig:
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return HeadConfig(
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_attention_heads=heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or heads),
        vocab_size=int(config["vocab_size"]),
        draft_vocab_size=draft_vocab,
        head_dim=int(config.get("head_dim") or hidden // heads),
        rope_theta=_rope_theta(_Obj(config)),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        **kw,
    )


def _eagle3(
    path: Path,
    config: dict[str, Any],
    weights: dict[str, torch.Tensor],
    device: torch.device | str,
    dtype: torch.dtype | None,
) -> EagleHead:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = int(config.get("draft_vocab_size") or config["vocab_size"])
    head = EagleHead(
        _config(
            config,
            draft_vocab,
            layout="eagle3",
            final_norm=True,
            target_layers=[int(i) + 1 for i in ids] if ids else [],
        )
    )
    state = {
        k.replace("midlayer.", "layers.0."): v
        for k, v in weights.items()
        if not k.startswith(("t2d", "embed_tokens", "d2t"))
    }
    offsets = weights.get("d2t", torch.zeros(draft_vocab, dtype=torch.long))
    state["d2t"] = torch.arange(draft_vocab, dtype=torch.long) + offsets.long()
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise InvalidParameterError(
            f"EAGLE-3 head {str(path)!r}: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
        )
    return head.to(device=device, dtype=dtype or torch.float32).eval()


class _Obj:
    """A config dict read like a config object (rope_theta, or rope_parameters' rope_theta)."""

    def __init__(self, data: dict[str, Any]):
        self.__dict__.update(data)


def save_eagle1(head: EagleHead, path: Path) -> Path:
    """Writes a head in EAGLE-1's published layout (for tests: a random head saved as vLLM would read it)."""
    from safetensors.torch import save_file

    c = head.config
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "num_hidden_layers": 1,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta,
        "head_dim": c.head_dim,
        "bias": True,
    }
    (path / "config.json").write_text(json.dumps(config))
    tensors = {
        k: v.contiguous()
        for k, v in head.state_dict().items()
        if k.startswith(("fc.", "layers.0.")) and "input_layernorm" not in k
    }
    tensors["embed_tokens.weight"] = head.embed_tokens.weight.detach().clone()
    save_file(tensors, str(path / "model.safetensors"))
    return path
