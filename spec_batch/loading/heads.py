"""Draft heads (core/heads/head.py) from a directory (config.json + model.safetensors), checked against the target they
are to draft for. The loading layer reads files only: a head named in SQL is resolved to a directory by the jobs
or CLI layer (spec_batch/jobs/heads.py) before it gets here."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core.drafting.drafter_registry import HEAD, HYBRID
from ..core.drafting.drafters import Drafter
from ..core.drafting.suffix_drafter import SuffixDrafter
from ..core.heads.head import HEAD_FORMAT, EagleHead, HeadConfig, eagle3_layers, stored_tensors
from ..core.heads.head_drafter import HeadDrafter
from ..core.heads.hybrid_drafter import DEFAULT_THRESHOLD, HybridDrafter
from ..errors import IncompatibleModelsError, InvalidParameterError
from .quant_linear import Int8Linear
from .weights import KERNEL_DTYPE, Precision, plain_linears, resolve_weights_name

HEAD_PREFIX, HYBRID_PREFIX = f"{HEAD.name}:", f"{HYBRID.name}:"  # the registry's prefix kinds
CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"


def save_head(head: EagleHead, directory: str | Path) -> Path:
    """Writes config.json and model.safetensors (bfloat16; the embedding, and a shared LM head, are the target's
    and are not saved)."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_FILE).write_text(json.dumps(head.config.to_json(), indent=2, sort_keys=True))
    save_file(stored_tensors(head), str(out / WEIGHTS_FILE))
    return out


def load_head(directory: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype | None = None) -> EagleHead:
    """A head saved by `save_head` (or a published layout, spec_batch/loading/head_layouts.py)."""
    from safetensors.torch import load_file

    path = Path(directory)
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise InvalidParameterError(
            f"draft head {str(path)!r}: no {CONFIG_FILE} there (a head directory holds "
            f"{CONFIG_FILE} and {WEIGHTS_FILE}; train one with `spec-batch drafters train`)"
        )
    data = json.loads(config_file.read_text())
    if data.get("format") != HEAD_FORMAT:
        from .head_layouts import load_published

        return load_published(path, data, device, dtype)
    head = EagleHead(HeadConfig.from_json(data))
    head.load_state_dict(load_file(str(path / WEIGHTS_FILE)), strict=True)
    return head.to(device=device, dtype=dtype or torch.float32).eval()


def check_head(head: EagleHead, target: Any, target_name: str, aliases: tuple[str, ...] = ()) -> None:
    """Refuses a head made for another target: hidden size, vocabulary, or the recorded target's name."""
    c = head.config
    t = target.config.get_text_config(decoder=True) if hasattr(target.config, "get_text_config") else target.config
    vocab = target.get_output_embeddings().weight.shape[0]
    where = f"draft head for {c.target or 'an unnamed target'!r} cannot draft for target {target_name!r}"
    if c.hidden_size != t.hidden_size:
        raise IncompatibleModelsError(f"{where}: hidden size {c.hidden_size}, the target's is {t.hidden_size}")
    if c.vocab_size != vocab or int(head.d2t.max()) >= vocab:
        raise IncompatibleModelsError(f"{where}: vocabulary of {c.vocab_size} tokens, the target's has {vocab}")
    if c.target and c.target not in (target_name, *aliases):
        raise IncompatibleModelsError(
            f"{where}: it was trained on another target's hidden states; train one for "
            f"{target_name!r} with `spec-batch drafters train`"
        )


@dataclass(frozen=True)
class HybridHead:
    """build_decoder's draft for `hybrid:`: suffix drafting where confident, this head elsewhere."""

    head: EagleHead
    threshold: float = DEFAULT_THRESHOLD


def head_factory(
    draft: EagleHead | HybridHead,
    target: Any,
    target_name: str,
    draft_name: str | None,
    device: torch.device,
    placeholder: int,
    weights: str | None = None,
) -> tuple[Callable[[], Drafter], str]:
    """(drafter factory, drafter name) of a loaded head over a loaded target (checked; the target's embedding).
    weights: how it drafts (`drafting_head`)."""
    head = draft.head if isinstance(draft, HybridHead) else draft
    check_head(head, target, target_name, aliases=(getattr(target.config, "_name_or_path", "") or "",))
    if head.config.layout == "eagle3" and not head.config.target_layers:
        head.config.target_layers = eagle3_layers(target.config.get_text_config(decoder=True).num_hidden_layers)
    head.attach(target.get_input_embeddings(), target.get_output_embeddings())
    head.to(device).eval()
    head = drafting_head(head, weights)
    vocab = target.get_output_embeddings().weight.shape[0]
    name = draft_name or f"head:{head.config.target or 'head'}"
    if isinstance(draft, HybridHead):
        name = draft_name or f"hybrid:{head.config.target or 'head'}"
        return (
            lambda: HybridDrafter(HeadDrafter(head, name, device, placeholder, vocab), SuffixDrafter(), draft.threshold)
        ), name
    return (lambda: HeadDrafter(head, name, device, placeholder, vocab)), name


def load_head_draft(draft: Any, device: torch.device, dtype: torch.dtype | None) -> tuple[Any, str] | None:
    """(build_decoder's draft, its name) for "head:/dir" or "hybrid:/dir"; None for any other draft."""
    if not isinstance(draft, str):
        return None
    for prefix in (HEAD_PREFIX, HYBRID_PREFIX):
        if draft.startswith(prefix):
            path = Path(draft[len(prefix) :]).expanduser()
            head = load_head(path, device, dtype)
            name = f"{prefix}{path.name}"
            return (HybridHead(head) if prefix == HYBRID_PREFIX else head), name
    return None


def head_weights(weights: str | None, device: torch.device) -> str:
    """The weights a head drafts with: full | int8. auto (and None): int8 on the CPU, full elsewhere."""
    name = resolve_weights_name(weights or "auto")
    if name == "int4":
        raise InvalidParameterError("draft_weights='int4': a draft head drafts in full or int8 weights (or auto)")
    if name == "auto":
        return "int8" if device.type == "cpu" else "full"
    return name


def head_precision(head: EagleHead, weights: str | None) -> Precision:
    """What decoder.precision reports for a head that drafts with these weights."""
    return Precision(head_weights(weights, head.device), head.dtype)


def drafting_head(head: EagleHead, weights: str | None) -> EagleHead:
    """The head a decoder drafts with. int8 (`head_weights`): a copy whose linear layers, and the rows of a shared
    LM head, are int8 per output channel (bfloat16 activations, as the target's int8 layers): at batch 1 a draft
    token reads every weight of the head once, so on a CPU its cost is their bytes; fp32 -> int8 cut a draft token
    of the default model's head ~2x (docs/heads.md). Only the proposals can change, never an output. The caller's
    head stays float (it may be trained on or saved). A head over the target's whole vocabulary reads the target's
    own LM head as the target runs it."""
    if head_weights(weights, head.device) == "full":
        return head
    if head.dtype not in (torch.float32, torch.bfloat16):
        raise InvalidParameterError(f"draft_weights='int8' needs a float32 or bfloat16 head, not {head.dtype}")
    quantized = EagleHead(HeadConfig.from_json(head.config.to_json()))
    quantized.load_state_dict(head.state_dict())
    quantized.to(device=head.device, dtype=head.dtype).eval()
    lm = head.__dict__.get("target_lm_head")
    quantized.attach(head.embed_tokens, lm)
    own_rows = head._lm_head()
    if own_rows is not lm:  # the head's own LM head, or the target's rows of the draft vocabulary
        quantized.lm_head = own_rows
    for parent, attr, linear in plain_linears(quantized).values():
        setattr(parent, attr, Int8Linear.quantize(linear.weight, linear.bias, KERNEL_DTYPE, device=head.device))
    return quantized
