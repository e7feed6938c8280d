"""Builds decoders, from loaded models (`build_decoder`) or from model names (`load_decoder`), and keeps the
process's one cache of them: `shared_model` (a loaded model per name and arguments) and `shared_decoder`
(a decoder per configuration), both emptied by `clear_cache`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch

from ..core.decoder import Decoder
from ..core.drafting.drafter_registry import DRAFTERS, SELF, DrafterKind, DraftSettings
from ..core.drafting.drafters import Drafter, ModelDrafter
from ..core.heads.head import EagleHead
from ..core.thread_governor import ThreadGovernor, cpu_governor
from ..errors import InvalidParameterError, UnknownModelError
from ..settings import get_settings
from .chat import apply_chat_template
from .decoder_spec import DecoderSpec, cache_dir_key, drafter_kind
from .heads import HybridHead, head_factory, head_precision, load_head_draft
from .llama_forward import forward_kind
from .load import LoadedModel, check_compatible, context_length, load_model, resolve_device, resolve_dtype
from .weights import Precision, resolve_precision, resolve_weights_name

__all__ = ["DecoderSpec", "build_decoder", "clear_cache", "load_decoder", "shared_decoder", "shared_model"]

DRAFTERS_WITHOUT_MODEL = DRAFTERS.named()  # the built-in kinds named whole, as registered at import
SELF_DRAFT = SELF.name  # draft "self:int4": the target's own file at other weights


def default_draft_tokens(draft: Any) -> int:
    """num_draft_tokens where none is given: the drafter kind's default (a draft model's is the core's)."""
    return drafter_kind(draft).default_draft_tokens


def build_decoder(
    target_model: Any,
    tokenizer: Any,
    *,
    target_name: str,
    draft: str | Any,
    draft_name: str | None = None,
    device: torch.device,
    num_draft_tokens: int | None = None,
    adaptive: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 3,
    drafter_options: Mapping[str, Any] | None = None,
    draft_weights: str | None = None,
    tree_width: int | None = None,
    precision: DecoderPrecision | None = None,
    draft_alias: str | None = None,
    latency_slack: float | None = None,
) -> Decoder:
    """A decoder over already-loaded models. draft: "suffix" | "ngram" | "none" | a loaded draft model | a head
    (EagleHead, HybridHead); draft_weights: how a head drafts, full | int8 | auto (None: auto, int8 on the CPU);
    tree_width: a head's draft trees at batch 1 (None: its default); num_draft_tokens: the longest draft per step
    (None: the drafter's default); drafter_options: the suffix drafter's (`SuffixDrafter.OPTIONS`), checked now;
    precision: what the decoder reports as `precision` (load_decoder's); draft_alias: the name the decoder reports
    as `draft_name` instead of its drafter's (a head as jobs and queues know it, head:NAME, not by its directory);
    latency_slack: the draft policy's bound on any row's slowdown (core/policy.py; None, a bulk job's: none)."""
    max_context = context_length(target_model)
    kind = drafter_kind(draft)
    tree_width = kind.tree_width(tree_width)  # a kind that grows no trees drafts chains whatever is asked
    placeholder = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    _check_draft_arguments(draft, kind, drafter_options, draft_weights)
    factory: Callable[[], Drafter]
    if isinstance(draft, str) and kind.make is not None:  # a kind made without a model (suffix, ngram, none, ...)
        factory, name = kind.factory(DraftSettings(dict(drafter_options or {}), ngram_min, ngram_max)), kind.name
    elif isinstance(draft, (EagleHead, HybridHead)):
        factory, name = head_factory(draft, target_model, target_name, draft_name, device, placeholder, draft_weights)
    else:
        draft_model, name = draft, draft_name or getattr(draft.config, "_name_or_path", None) or "draft-model"
        max_context = min(max_context, context_length(draft_model))
        vocab = target_model.get_output_embeddings().weight.shape[0]
        factory = lambda: ModelDrafter(draft_model, name, device, placeholder, vocab)
    return Decoder(
        target_model,
        tokenizer,
        target_name=target_name,
        drafter_factory=factory,
        draft_name=draft_alias or name,
        device=device,
        max_context=max_context,
        num_draft_tokens=kind.default_draft_tokens if num_draft_tokens is None else num_draft_tokens,
        adaptive=adaptive,
        chat_template=lambda messages: apply_chat_template(tokenizer, messages, model_name=target_name),
        tree_width=tree_width,
        uses_memory=kind.drafts_from_memory,
        precision=precision,
        latency_slack=latency_slack,
        threads=_thread_governor(target_model, device),
    )


def _thread_governor(target_model: Any, device: torch.device) -> ThreadGovernor | None:
    """A governor of the CPU threads where the forward is ours (the native kernels: the same bits at any thread
    count) and SPEC_BATCH_ADAPT_THREADS allows; Hugging Face's forward keeps torch's count (its matmuls' bits may
    follow it)."""
    if not get_settings().adapt_threads or forward_kind(target_model) != "own":
        return None
    return cpu_governor(device)


def _check_draft_arguments(
    draft: Any, kind: DrafterKind, drafter_options: Mapping[str, Any] | None, draft_weights: str | None
) -> None:
    """drafter_options belong to a kind that has options (suffix); draft_weights other than auto/full to a head."""
    if drafter_options and not kind.options:
        takers = " or ".join(repr(k.name) for k in DRAFTERS.kinds() if k.options)
        raise InvalidParameterError(f"drafter_options are options of the {takers} drafter, not of {draft!r}")
    if resolve_weights_name(draft_weights) not in ("auto", "full") and not isinstance(draft, (EagleHead, HybridHead)):
        msg = f"draft_weights={draft_weights!r} applies here to a head; a draft model is loaded at its weights by "
        raise InvalidParameterError(msg + "load_decoder")


def load_decoder(
    target: Any = "default",
    draft: Any = "suffix",
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    *,
    tokenizer: Any = None,
    draft_tokenizer: Any = None,
    num_draft_tokens: int | None = None,
    adaptive: bool = True,
    ngram_min: int = 1,
    ngram_max: int = 3,
    drafter_options: Mapping[str, Any] | None = None,
    cache_dir: str | None = None,
    trust_remote_code: bool = False,
    weights: str | None = None,
    draft_weights: str | None = None,
    tree_width: int | None = None,
    draft_alias: str | None = None,
    latency_slack: float | None = None,
) -> Decoder:
    """target: "default" | hub id | local dir | .gguf path | a loaded HF model (then tokenizer= is required).
    draft: "suffix" | "ngram" | "none" | "self[:WEIGHTS]" (the target's own file at other weights, int4 when
    none is named: gpt-fast's pairing) | a model spec like target | a loaded HF model (it shares the target's
    tokenizer unless draft_tokenizer= is given) | "head:DIR" / "hybrid:DIR". weights / draft_weights: full | int8 |
    int4 | auto (loading/weights.py; None: full; a head drafts in full or int8, auto and None: int8 on the CPU);
    dtype stays the compute dtype; tree_width as build_decoder's. Models named by string are loaded once per process
    and shared (`shared_model`); the decoder itself is new: `shared_decoder` is the cached form.
    The decoder's `precision` attribute holds the effective (weights, dtype) pairs of its target and draft model;
    draft_alias, latency_slack: build_decoder's. `DecoderSpec.of(...)` is the hashable form of these arguments, for names."""
    device = torch.device(device)
    target, draft = _fspath(target), _fspath(draft)
    options = dict(device=device, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    loaded = _target_model(target, tokenizer, dtype, weights, options)
    draft_arg, draft_name, draft_precision = _draft_model(draft, loaded, draft_tokenizer, dtype, draft_weights, options)
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
        drafter_options=drafter_options,
        draft_weights=draft_weights if isinstance(draft_arg, (EagleHead, HybridHead)) else None,
        tree_width=tree_width,
        precision=DecoderPrecision(_precision_of(loaded), draft_precision),
        draft_alias=draft_alias,
        latency_slack=latency_slack,
    )


@dataclass(frozen=True)
class DecoderPrecision:
    """The effective (weights, dtype) of a decoder's target, and of its draft model (None without one)."""

    target: Precision
    draft: Precision | None = None

    def to_dict(self) -> dict[str, str | None]:
        d = self.draft
        return {
            "weights": self.target.weights,
            "dtype": self.target.dtype_name,
            "draft_weights": d.weights if d else None,
            "draft_dtype": d.dtype_name if d else None,
        }


def _fspath(value: Any) -> Any:
    return os.fspath(value) if isinstance(value, os.PathLike) else value


def _precision_of(loaded: LoadedModel) -> Precision:
    return loaded.precision or Precision("full", loaded.model.dtype)


def _target_model(target: Any, tokenizer: Any, dtype, weights: str | None, options: dict) -> LoadedModel:
    if isinstance(target, str):
        loaded = shared_model(target, dtype=dtype, weights=weights, **options)
    else:
        if tokenizer is None:
            raise InvalidParameterError("a loaded target model needs tokenizer= as well")
        if weights not in (None, "full"):
            raise InvalidParameterError(f"weights={weights!r} applies to models loaded by name; this target is loaded")
        target.eval()
        loaded = LoadedModel(
            model=target, tokenizer=tokenizer, name=getattr(target.config, "_name_or_path", "") or "target", source=""
        )
    if tokenizer is not None:
        loaded = LoadedModel(
            model=loaded.model, tokenizer=tokenizer, name=loaded.name, source=loaded.source, precision=loaded.precision
        )
    return loaded


def _draft_model_weights(draft_weights: str | None) -> str:
    """A draft model's weights: as asked, and auto (the default) full: a target's auto (w4a8) is for targets."""
    name = resolve_weights_name(draft_weights)
    return "full" if name == "auto" else name


def self_draft_weights(draft: str) -> str | None:
    """'self' -> 'int4', 'self:int8' -> 'int8'; None when draft does not name the target itself."""
    head, _, tail = draft.partition(":")
    if head != SELF_DRAFT:
        return None
    return resolve_weights_name(tail or "int4")


def _draft_model(
    draft: Any, loaded: LoadedModel, draft_tokenizer: Any, dtype, draft_weights: str | None, options: dict
) -> tuple[Any, str | None, Precision | None]:
    """(the build_decoder draft argument, its name, its precision) for a drafter name or a draft model."""
    if isinstance(draft, str) and drafter_kind(draft).make is not None:  # drafts without a model
        return draft, None, None
    head = load_head_draft(draft, loaded.model.device, loaded.model.dtype)  # head:/dir, hybrid:/dir
    if head is not None:
        loaded_head = head[0].head if isinstance(head[0], HybridHead) else head[0]
        return head[0], head[1], head_precision(loaded_head, draft_weights)
    if isinstance(draft, str):
        self_weights = self_draft_weights(draft)
        spec = loaded.name if self_weights is not None else draft
        if self_weights is not None and not isinstance(spec, str):
            raise InvalidParameterError(f"draft {draft!r} needs a target named by string")
        weights = self_weights or _draft_model_weights(draft_weights)
        try:
            dloaded = shared_model(spec, dtype=dtype, weights=weights, **options)
        except UnknownModelError as exc:  # most likely a drafter's name mistyped
            raise UnknownModelError(f"draft {draft!r}: no drafter of that name ({DRAFTERS.usage()}); {exc}") from exc
        if self_weights is not None and dloaded.model is loaded.model:
            raise InvalidParameterError(
                f"draft {draft!r} is the target itself (same file at the same weights): it would cost a target "
                "forward per draft token; draft at other weights (e.g. the target at full, draft self:int4)"
            )
        check_compatible(loaded, dloaded)
        return dloaded.model, (f"{SELF_DRAFT}:{weights}" if self_weights else dloaded.name), _precision_of(dloaded)
    draft.eval()
    dloaded = LoadedModel(
        model=draft,
        tokenizer=draft_tokenizer if draft_tokenizer is not None else loaded.tokenizer,
        name=getattr(draft.config, "_name_or_path", "") or "draft-model",
        source="",
    )
    check_compatible(loaded, dloaded)
    return draft, dloaded.name, _precision_of(dloaded)


# ---------------------------------------------------------------- the per-process cache

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _OncePerKey(Generic[K, V]):
    """Values made at most once per key and kept for the process. Callers of one key wait for a single make();
    other keys are made in parallel. A failed make is not kept: the next call tries again (and raises again)."""

    def __init__(self) -> None:
        self._values: dict[K, V] = {}
        self._making: dict[K, threading.Lock] = {}
        self._lock = threading.Lock()

    def get(self, key: K, make: Callable[[], V]) -> V:
        with self._lock:
            if key in self._values:
                return self._values[key]
            making = self._making.setdefault(key, threading.Lock())
        with making:
            with self._lock:
                if key in self._values:
                    return self._values[key]
            value = make()
            with self._lock:
                self._values[key] = value
            return value

    def clear(self) -> None:
        with self._lock:
            self._values.clear()
            self._making.clear()


_models: _OncePerKey[tuple, LoadedModel] = _OncePerKey()
_decoders: _OncePerKey[DecoderSpec, Decoder] = _OncePerKey()


def shared_model(
    spec: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    weights: str | None = None,
) -> LoadedModel:
    """`load_model`, once per process for the same (spec, device, effective weights and dtype, cache_dir,
    trust_remote_code)."""
    dev = resolve_device(device)
    precision = resolve_precision(weights, dtype, dev, resolve_dtype(dtype, dev))
    key = (os.fspath(spec), str(dev), precision, cache_dir_key(cache_dir), bool(trust_remote_code))
    return _models.get(
        key,
        lambda: load_model(
            spec,
            device=dev,
            dtype=precision.dtype,
            cache_dir=cache_dir,
            trust_remote_code=trust_remote_code,
            weights=precision.weights,
        ),
    )


def shared_decoder(
    target: str | os.PathLike = "default",
    draft: str | os.PathLike = "suffix",
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    num_draft_tokens: int | None = None,
    adaptive: bool = True,
    cache_dir: str | os.PathLike | None = None,
    weights: str | None = None,
    draft_weights: str | None = None,
    tree_width: int | None = None,
    drafter_options: Mapping[str, Any] | None = None,
) -> Decoder:
    """The process's decoder for this configuration, built by `load_decoder` on first use and then shared.

    target and draft are names (draft also a registered drafter: `DRAFTERS.listing()`). The same arguments (after
    defaults, with device and dtype resolved: "cpu" and torch.device("cpu") are one key) give the same Decoder,
    which decodes one request batch at a time: the key is their `DecoderSpec`. Thread-safe: concurrent first
    calls load once; a failed load is not cached.
    """
    for what, name in (("target", target), ("draft", draft)):
        if not isinstance(name, (str, os.PathLike)):
            raise InvalidParameterError(
                f"shared_decoder takes model names; {what} is a {type(name).__name__} "
                "(use build_decoder or load_decoder for loaded models)"
            )
    spec = DecoderSpec.of(
        target,
        draft,
        device=device,
        dtype=dtype,
        num_draft_tokens=num_draft_tokens,
        adaptive=adaptive,
        cache_dir=cache_dir,
        weights=weights,
        draft_weights=draft_weights,
        tree_width=tree_width,
        drafter_options=drafter_options,
    )
    args, kwargs = spec.load_call()
    return _decoders.get(spec, lambda: load_decoder(*args, **kwargs))


def clear_cache() -> None:
    """Forgets every shared decoder and model of this process (their memory is freed once nothing else holds them)."""
    _decoders.clear()
    _models.clear()
