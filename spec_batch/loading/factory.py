"""Builds decoders: from loaded models (`build_decoder`) or from model specs (`load_decoder`)."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..core.decoder import Decoder
from ..core.drafters import Drafter, ModelDrafter, NgramDrafter, NoDrafter
from ..errors import InvalidParameterError
from .load import LoadedModel, apply_chat_template, check_compatible, context_length, load_model


def build_decoder(
    target_model: Any,
    tokenizer: Any,
    *,
    target_name: str,
    draft: str | Any,
    draft_name: str | None = None,
    device: torch.device,
    num_draft_tokens: int = 8,
    adaptive: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 3,
) -> Decoder:
    """A decoder over already-loaded models. draft: "ngram" | "none" | a loaded draft model."""
    max_context = context_length(target_model)
    placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if draft == "none":
        factory: Callable[[], Drafter] = NoDrafter
        name = "none"
    elif draft == "ngram":
        NgramDrafter(ngram_min, ngram_max)  # validates the sizes now, not at the first decode
        factory = lambda: NgramDrafter(ngram_min, ngram_max)  # noqa: E731
        name = "ngram"
    else:
        draft_model = draft
        name = draft_name or getattr(draft_model.config, "_name_or_path", None) or "draft-model"
        max_context = min(max_context, context_length(draft_model))
        vocab = target_model.get_output_embeddings().weight.shape[0]
        factory = lambda: ModelDrafter(draft_model, name, device, placeholder, vocab)  # noqa: E731
    return Decoder(
        target_model,
        tokenizer,
        target_name=target_name,
        drafter_factory=factory,
        draft_name=name,
        device=device,
        max_context=max_context,
        num_draft_tokens=num_draft_tokens,
        adaptive=adaptive,
        chat_template=lambda messages: apply_chat_template(tokenizer, messages, model_name=target_name),
    )


def load_decoder(
    target: Any = "default",
    draft: Any = "ngram",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    *,
    tokenizer: Any = None,
    draft_tokenizer: Any = None,
    num_draft_tokens: int = 8,
    adaptive: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 3,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
) -> Decoder:
    """target: "default" | hub id | local dir | .gguf path | a loaded HF model (then tokenizer= is required).
    draft: "ngram" | "none" | a model spec like target | a loaded HF model (it shares the target's tokenizer
    unless draft_tokenizer= is given). Models named by string are loaded once per process and shared."""
    device = torch.device(device)
    if isinstance(target, os.PathLike):
        target = os.fspath(target)
    if isinstance(draft, os.PathLike):
        draft = os.fspath(draft)
    if isinstance(target, str):
        loaded = load_model(target, device=device, dtype=dtype, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    else:
        if tokenizer is None:
            raise InvalidParameterError("a loaded target model needs tokenizer= as well")
        target.eval()
        loaded = LoadedModel(model=target, tokenizer=tokenizer, name=getattr(target.config, "_name_or_path", "") or "target", source="")
    if tokenizer is not None:
        loaded = LoadedModel(model=loaded.model, tokenizer=tokenizer, name=loaded.name, source=loaded.source)

    draft_arg: Any = draft
    draft_name = None
    if isinstance(draft, str) and draft not in ("ngram", "none"):
        dloaded = load_model(draft, device=device, dtype=dtype, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
        check_compatible(loaded, dloaded)
        draft_arg, draft_name = dloaded.model, dloaded.name
    elif not isinstance(draft, str):
        draft.eval()
        dloaded = LoadedModel(
            model=draft,
            tokenizer=draft_tokenizer if draft_tokenizer is not None else loaded.tokenizer,
            name=getattr(draft.config, "_name_or_path", "") or "draft-model",
            source="",
        )
        check_compatible(loaded, dloaded)
        draft_name = dloaded.name
    return build_decoder(
        loaded.model,
        loaded.tokenizer,
        target_name=loaded.name,
        draft=draft_arg,
        draft_name=draft_name,
        device=device,
        num_draft_tokens=num_draft_tokens,
        adaptive=adaptive,
        ngram_min=ngram_min,
        ngram_max=ngram_max,
    )
