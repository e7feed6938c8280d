"""Loading a resolved model and its tokenizer onto a device, and checking that a draft fits a target.

Loading here is uncached: `factory.shared_model` keeps one LoadedModel per process and arguments.
Everything here is for the caller of the decoding core; the core itself receives loaded models.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import IncompatibleModelsError, InvalidParameterError, UnknownModelError
from ..settings import get_settings
from . import gguf_cache
from .cpu_attention import use_gqa_attention
from .cpu_linear import pack_linear_weights
from .fused_projections import fuse_projections
from .gguf_cache import CacheEntry
from .huge_pages import move_to_huge_pages
from .kernels import KernelBuildError, native_ops
from .llama_forward import use_own_forward
from .resolve import resolve_spec
from .weights import BLOCKS, QUANTIZED, Precision, dtype_is_auto, quantize_model, resolve_precision

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "FALLBACK_CONTEXT_LENGTH",
    "CacheEntry",
    "LoadedModel",
    "check_compatible",
    "context_length",
    "list_cache",
    "load_model",
    "resolve_device",
    "resolve_dtype",
]

# Used when a model's config names no context length: large, so the length check never bites.
FALLBACK_CONTEXT_LENGTH = 1 << 20

_CONTEXT_ATTRS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "max_sequence_length",
    "seq_length",
    "n_ctx",
    "max_seq_length",
)


@dataclass(eq=False)  # identity semantics: hashable, usable as a dict key
class LoadedModel:
    """A model ready for decoding: eval mode, on its device, gradients off."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # display name: "default" / hub id / path as given
    source: str  # resolved path actually loaded (the cache entry for a GGUF file)
    precision: Precision | None = None  # the effective (weights, dtype); None for a model passed in loaded

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype


# ---------------------------------------------------------------- dtype and device


_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device | str) -> torch.dtype:
    """None or "auto": bfloat16 on CUDA (float16 where the GPU lacks bf16), float32 elsewhere.

    Otherwise "float32"/"fp32", "bfloat16"/"bf16", "float16"/"fp16", or one of those torch dtypes.
    """
    device = torch.device(device)
    if dtype is None or (isinstance(dtype, str) and dtype.strip().lower() == "auto"):
        if device.type == "cuda":
            if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
                return torch.float16
            return torch.bfloat16
        return torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16, torch.float16):
            return dtype
        raise InvalidParameterError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
    if isinstance(dtype, str):
        key = dtype.strip().lower().removeprefix("torch.")
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    raise InvalidParameterError(
        f"dtype {dtype!r} is not supported; use 'auto', 'float32', 'bfloat16', 'float16' or a torch dtype"
    )


def requested_precision(
    weights: str | None, dtype: str | None, device: str | torch.device = "cpu"
) -> tuple[str, str | None]:
    """The (weights, dtype) names a queued job stores and is routed by: weights resolved for `device` (auto -> its
    choice there; a submitting machine does not know the worker's device and resolves as for the CPU), dtype
    normalized, or None where the worker's device picks it (full weights). Raises InvalidParameterError for an
    unknown name, a device torch does not know, or a pair the kernels do not run (int4 with float16)."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidParameterError(f"device {device!r} is not a torch device ({exc})") from exc
    resolved = resolve_dtype(dtype, dev)
    precision = resolve_precision(weights, dtype, dev, resolved)
    if dtype_is_auto(dtype):
        return precision.weights, None
    return precision.weights, precision.dtype_name


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidParameterError(f"device {device!r} is not a torch device ({exc})") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise InvalidParameterError(f"device {device!r}: CUDA is not available on this machine; use 'cpu'")
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.index >= torch.cuda.device_count():
            raise InvalidParameterError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    elif dev.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidParameterError(f"device {device!r}: MPS is not available on this machine; use 'cpu'")
    return dev


# ---------------------------------------------------------------- loading


def load_model(
    spec: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
    weights: str | None = None,
) -> LoadedModel:
    """Loads a target or draft model and its tokenizer (see resolve.py for the names a model may have).

    Every call loads again; `factory.shared_model` is the cached form. GGUF files are converted into
    ``cache_dir`` (settings' cache dir when None) once. weights: full | int8 | int4 | auto (weights.py); a GGUF
    file's Q4_0/Q4_1/Q8_0 tensors are then used as they ship. Raises UnknownModelError, DefaultModelMissingError,
    InvalidParameterError.
    """
    dev = resolve_device(device)
    precision = resolve_precision(weights, dtype, dev, resolve_dtype(dtype, dev))
    resolved = resolve_spec(spec)
    if resolved.kind == "gguf":
        entry = gguf_cache.ensure_converted(resolved.path, cache_dir)
        try:
            return _load_dir(entry, resolved.name, dev, precision, trust_remote_code, resolved.path)
        except UnknownModelError:
            # The entry passed its checks but does not load (e.g. corrupted bytes inside a tensor
            # header): move it aside and convert once more.
            gguf_cache.discard_entry(entry)
            entry = gguf_cache.ensure_converted(resolved.path, cache_dir)
            return _load_dir(entry, resolved.name, dev, precision, trust_remote_code, resolved.path)
    return _load_dir(resolved.path, resolved.name, dev, precision, trust_remote_code)


def _load_dir(
    path: Path,
    name: str,
    device: torch.device,
    precision: Precision,
    trust_remote_code: bool,
    gguf_path: Path | None = None,
) -> LoadedModel:
    dtype = precision.dtype
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    common: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    step = "config"
    try:
        config = AutoConfig.from_pretrained(path, **common)
        step = "weights"
        kwargs: dict[str, Any] = dict(common, dtype=dtype, config=config)
        if device.type != "cpu":
            kwargs["device_map"] = {"": device}
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        step = "tokenizer"
        tokenizer = AutoTokenizer.from_pretrained(path, **common)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as exc:
        msg = str(exc)
        if "trust_remote_code" in msg and not trust_remote_code:
            raise UnknownModelError(
                f"model {name!r} ({path}) needs custom code from its repository, which is not run unless "
                f"you pass trust_remote_code=True (only for code you trust). Detail: {msg}"
            ) from exc
        raise UnknownModelError(
            f"model {name!r}: its {step} could not be loaded from {path}: {type(exc).__name__}: {msg}"
        ) from exc
    if device.type == "cpu" and model.device != device:
        model = model.to(device)
    model.eval()
    model.requires_grad_(False)
    native = device.type == "cpu" and _native_ops(precision)
    if precision.weights in QUANTIZED:
        quantize_model(model, precision.weights, gguf_path=gguf_path, entry_dir=path if gguf_path is not None else None)
    elif get_settings().pack_weights:  # CPU only: a verify step of several tokens then costs little more than one
        pack_linear_weights(model)
    fuse_projections(model)  # q/k/v and gate/up in one call each: fewer small kernel calls, the same bits
    if device.type == "cpu" and get_settings().huge_pages:
        move_to_huge_pages(model)  # before anything holds the tensors: a decode step streams them all
    use_gqa_attention(model, native=native)
    _own_forward(model)
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(path), precision=precision)


def _own_forward(model: Any) -> None:
    """Our Llama-family forward as settings' SPEC_BATCH_FORWARD says (loading/llama_forward.py: the same bits)."""
    try:
        use_own_forward(model, get_settings().forward)
    except ValueError as exc:
        raise InvalidParameterError(str(exc)) from exc


def _native_ops(precision: Precision) -> bool:
    """Loads the native CPU kernels as settings' SPEC_BATCH_COMPILE says; weights that need them fail clearly."""
    choice = get_settings().compile
    try:
        ready = native_ops(choice)
    except KernelBuildError as exc:
        raise InvalidParameterError(f"SPEC_BATCH_COMPILE=on, but {exc}") from exc
    if precision.weights in BLOCKS and not ready:
        why = "SPEC_BATCH_COMPILE=off" if choice == "off" else "no C++ compiler was found (or it failed; see the log)"
        raise InvalidParameterError(f"weights={precision.weights!r} needs the native CPU kernels, but {why}")
    return ready


# ---------------------------------------------------------------- compatibility


def _embedding_rows(model: Any) -> int | None:
    try:
        emb = model.get_input_embeddings()
        return int(emb.weight.shape[0])
    except (AttributeError, NotImplementedError, TypeError):
        size = getattr(getattr(model, "config", None), "vocab_size", None)
        return int(size) if size is not None else None


def _output_rows(model: Any) -> int | None:
    try:
        head = model.get_output_embeddings()
    except (AttributeError, NotImplementedError, TypeError):
        return None
    if head is None:
        return None
    weight = getattr(head, "weight", None)
    return int(weight.shape[0]) if weight is not None else None


def _special_tokens(tokenizer: Any) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token"):
        out[attr] = getattr(tokenizer, attr, None)
    return out


def _first_vocab_difference(target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int]) -> str:
    t_by_id = {i: tok for tok, i in target_vocab.items()}
    d_by_id = {i: tok for tok, i in draft_vocab.items()}
    for i in sorted(set(t_by_id) | set(d_by_id)):
        t, d = t_by_id.get(i), d_by_id.get(i)
        if t != d:
            return f"first difference at token id {i}: target has {t!r}, draft has {d!r}"
    return "the vocabularies map tokens to ids differently"  # pragma: no cover (dict inequality implies a diff)


def check_compatible(target: LoadedModel, draft: LoadedModel) -> None:
    """Raises IncompatibleModelsError unless the draft can propose tokens for the target.

    Requires the same vocabulary (token -> id, added tokens included) and the same special tokens
    (bos/eos/unk/pad by content and id). Models whose embedding or output matrices have different
    numbers of rows are fine when every real token has a row in both (the rest are padding rows).
    """
    where = f"target {target.name!r} and draft {draft.name!r}"
    t_vocab, d_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if t_vocab != d_vocab:
        raise IncompatibleModelsError(
            f"{where} have different tokenizers ({len(t_vocab)} vs {len(d_vocab)} tokens); "
            f"{_first_vocab_difference(t_vocab, d_vocab)}. A draft model must share the target's tokenizer; "
            "use the n-gram drafter or a draft from the same model family."
        )
    t_special, d_special = _special_tokens(target.tokenizer), _special_tokens(draft.tokenizer)
    for attr in t_special:
        if t_special[attr] != d_special[attr]:
            raise IncompatibleModelsError(
                f"{where} have different {attr}: target {t_special[attr]!r}, draft {d_special[attr]!r}"
            )
    n_tokens = max(t_vocab.values(), default=-1) + 1
    for label, m in (("target", target), ("draft", draft)):
        for what, rows in (("embedding", _embedding_rows(m.model)), ("output", _output_rows(m.model))):
            if rows is not None and rows < n_tokens:
                raise IncompatibleModelsError(
                    f"{where}: the {label} model's {what} matrix has {rows} rows but the tokenizer has "
                    f"{n_tokens} token ids; token ids {rows}..{n_tokens - 1} cannot be scored"
                )


# ---------------------------------------------------------------- context length and cache listing


def context_length(model: Any) -> int:
    """The model's maximum sequence length from its config; FALLBACK_CONTEXT_LENGTH when it names none."""
    config = getattr(model, "config", model)
    candidates = [config]
    get_text = getattr(config, "get_text_config", None)
    if callable(get_text):
        try:
            candidates.insert(0, get_text())
        except Exception:  # pragma: no cover - odd configs
            pass
    for cfg in candidates:
        for attr in _CONTEXT_ATTRS:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return FALLBACK_CONTEXT_LENGTH


def list_cache(cache_dir: str | os.PathLike | None = None) -> list[CacheEntry]:
    """The converted GGUF entries in the cache (settings' cache dir when None), valid or not."""
    return gguf_cache.list_entries(cache_dir)
