"""GGUF -> safetensors conversion cache.

Loading a GGUF file through transformers dequantizes every tensor (about 16 s for the 135M default
on two cores). The first load of a GGUF file converts it once into an ordinary Hugging Face
directory (model.safetensors, config.json, tokenizer files); later loads read that directory.

Layout: ``<cache_dir>/gguf/<entry key>/`` where the key is the file's stem plus a hash of
(content, size, format version), so a different or modified GGUF file gets its own entry and the same file
installed elsewhere (a new virtualenv) reuses its conversion. An entry is written into a temporary directory
beside it and renamed into place only when complete; the last file written is ``spec_batch_entry.json``
(the marker), which records every file's size. An entry without a valid marker, with a missing or short file,
an unreadable config.json or a safetensors file whose header does not match its length is treated as corrupt
and rebuilt.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import UnknownModelError

# Bump when the conversion changes: old entries then get new keys and are rebuilt.
CACHE_FORMAT = 1
MARKER = "spec_batch_entry.json"
GGUF_MAGIC = b"GGUF"
SUBDIR = "gguf"
DIGESTS = ".digests"  # under the cache root: content digests by (path, size, mtime), see entry_key

try:  # POSIX: serialize concurrent conversions of the same file across processes.
    import fcntl
except ImportError:  # pragma: no cover - Windows: conversions may race; the rename keeps them atomic.
    fcntl = None  # type: ignore[assignment]


@dataclass(frozen=True)
class CacheEntry:
    """One converted GGUF file in the cache (what `spec-batch models` lists)."""

    key: str
    path: Path
    source: str | None  # the GGUF file it was converted from, per its marker
    size_bytes: int
    valid: bool
    problem: str | None  # why the entry is not valid (it will be rebuilt on next load)
    created: float | None  # unix time the entry was completed


def is_gguf_file(path: Path) -> bool:
    """True when the file starts with the GGUF magic. Raises OSError if it cannot be read."""
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def entry_key(gguf_path: Path, memo_dir: Path | None = None) -> str:
    """Cache key for a GGUF file: its stem (readable) and a hash of its content and size. By content, not by
    path: a reinstalled package (a new virtualenv, a fresh clone) has the same file elsewhere, and converting
    it again costs ~30 s. Hashing reads the file (~0.2 s for the default's 90 MB); memo_dir keeps each
    (path, size, mtime)'s digest so a later load does not read it again."""
    resolved = Path(gguf_path).resolve()
    st = resolved.stat()
    ident = hashlib.sha256(f"{resolved}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:32]
    memo = memo_dir / ident if memo_dir is not None else None
    content = None
    if memo is not None:
        with contextlib.suppress(OSError):
            content = memo.read_text().strip() or None
    if content is None:
        h = hashlib.blake2b(digest_size=16)
        with open(resolved, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        content = h.hexdigest()
        if memo is not None:
            with contextlib.suppress(OSError):
                memo.parent.mkdir(parents=True, exist_ok=True)
                tmp = memo.with_name(f".{ident}.{os.getpid()}")
                tmp.write_text(content)
                os.replace(tmp, memo)  # atomic: a concurrent reader sees the whole digest or none
    digest = hashlib.sha256(f"{CACHE_FORMAT}\0{st.st_size}\0{content}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.stem)[:64] or "model"
    return f"{stem}-{digest}"


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    """The directory holding converted GGUF entries: ``<cache_dir>/gguf``; settings' cache dir when None."""
    if cache_dir is None:
        from ..settings import get_settings

        cache_dir = get_settings().cache_dir
    return Path(cache_dir).expanduser() / SUBDIR


def _safetensors_problem(path: Path) -> str | None:
    """None when the file's header is readable and its tensors end exactly at the end of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                return f"{path.name}: shorter than a safetensors header"
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8 or n > 100 * 1024 * 1024:
                return f"{path.name}: header length {n} does not fit a {size}-byte file"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as exc:
        return f"{path.name}: unreadable ({exc})"
    end = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (KeyError, TypeError, IndexError, ValueError):
            return f"{path.name}: malformed header entry {name!r}"
    if 8 + n + end != size:
        return f"{path.name}: truncated or padded ({size} bytes, header says {8 + n + end})"
    return None


def entry_problem(entry_dir: Path) -> str | None:
    """None when the entry is complete and loadable; otherwise what is wrong with it."""
    marker = entry_dir / MARKER
    try:
        meta = json.loads(marker.read_text())
        files: dict[str, int] = meta["files"]
        if meta.get("format") != CACHE_FORMAT:
            return f"format {meta.get('format')!r} is not {CACHE_FORMAT}"
    except FileNotFoundError:
        return f"no {MARKER} (incomplete entry)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MARKER} ({exc})"
    for name, size in files.items():
        p = entry_dir / name
        try:
            actual = p.stat().st_size
        except OSError:
            return f"missing {name}"
        if actual != size:
            return f"{name} is {actual} bytes, expected {size}"
    try:
        json.loads((entry_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return f"config.json unreadable ({exc})"
    weights = sorted(entry_dir.glob("*.safetensors"))
    if not weights:
        return "no .safetensors weights"
    for w in weights:
        problem = _safetensors_problem(w)
        if problem:
            return problem
    if not any((entry_dir / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return "no tokenizer files"
    return None


@contextlib.contextmanager
def _locked(root: Path, key: str) -> Iterator[None]:
    if fcntl is None:  # pragma: no cover
        yield
        return
    with open(root / f".{key}.lock", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Loads a GGUF file with transformers (dequantizing to float32) and saves it as an HF directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers marks a GGUF-loaded model "quantized with gguf" and refuses to save it, although
    # the weights are already dequantized: drop the marks.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def ensure_converted(
    gguf_path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    converter: Callable[[Path, Path], None] | None = None,
) -> Path:
    """Returns the cache directory holding the converted GGUF file, converting it first if needed.

    converter(gguf_file, out_dir) writes the HF directory; convert_gguf when None.
    Raises UnknownModelError when the file is missing, unreadable, not GGUF, or cannot be converted.
    """
    if converter is None:
        converter = convert_gguf
    src, root, key = _source_entry(gguf_path, cache_dir)
    final = root / key
    if entry_problem(final) is None:
        return final
    with _locked(root, key):
        if entry_problem(final) is None:  # another process finished it while we waited
            return final
        # Holding the lock: leftovers of this key are from crashed writers.
        for stale in root.glob(f".tmp-{key}-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        try:
            _convert_into(tmp, src, str(gguf_path), converter)
            _swap_into_place(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return final


def _source_entry(gguf_path: str | os.PathLike, cache_dir: str | os.PathLike | None) -> tuple[Path, Path, str]:
    """The checked source file, the cache root (created) and the file's cache key."""
    src = Path(gguf_path).expanduser()
    try:
        if not src.is_file():
            raise UnknownModelError(f"GGUF file {str(gguf_path)!r} does not exist or is not a file")
        if not is_gguf_file(src):
            raise UnknownModelError(
                f"{str(gguf_path)!r} is not a GGUF file (it does not start with the GGUF magic bytes)"
            )
        root = cache_root(cache_dir)
        root.mkdir(parents=True, exist_ok=True)
        return src, root, entry_key(src, root / DIGESTS)
    except OSError as exc:
        raise UnknownModelError(f"GGUF file {str(gguf_path)!r} cannot be read: {exc}") from exc


def _convert_into(tmp: Path, src: Path, shown: str, converter: Callable[[Path, Path], None]) -> None:
    """Converts src into the fresh directory tmp and writes its marker; raises UnknownModelError for a file the
    converter cannot handle or a result that is not a complete entry."""
    try:
        converter(src.resolve(), tmp)
    except UnknownModelError:
        raise
    except Exception as exc:  # transformers raises ValueError/KeyError/... for unsupported files
        raise UnknownModelError(
            f"GGUF file {shown!r} could not be converted: {type(exc).__name__}: {exc}. "
            "Only architectures that transformers' GGUF loader supports can be used."
        ) from exc
    meta = {
        "format": CACHE_FORMAT,
        "source": str(src.resolve()),
        "source_size": src.stat().st_size,
        "source_mtime_ns": src.stat().st_mtime_ns,
        "created": time.time(),
        "files": {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()},
    }
    _write_marker(tmp, meta)
    problem = entry_problem(tmp)
    if problem:
        raise UnknownModelError(f"converting {shown!r} produced a bad cache entry: {problem}")


def _write_marker(directory: Path, meta: dict) -> None:
    path = directory / MARKER
    with open(path, "w") as f:
        json.dump(meta, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    # Make the weights durable before the rename publishes them.
    for p in directory.iterdir():
        if p.is_file() and p.name != MARKER:
            with open(p, "rb") as f:
                os.fsync(f.fileno())


def _swap_into_place(tmp: Path, final: Path) -> None:
    """Renames tmp to final; a corrupt entry already at final is moved aside first and deleted."""
    if final.exists() or final.is_symlink():
        trash = final.with_name(f".trash-{final.name}-{os.getpid()}-{time.time_ns()}")
        os.replace(final, trash)
        try:
            os.replace(tmp, final)
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(tmp, final)


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        with contextlib.suppress(OSError):
            if p.is_file():
                total += p.stat().st_size
    return total


def list_entries(cache_dir: str | os.PathLike | None = None) -> list[CacheEntry]:
    """Every entry in the cache, valid or not (temporary and trash directories are skipped)."""
    root = cache_root(cache_dir)
    if not root.is_dir():
        return []
    out: list[CacheEntry] = []
    for d in sorted(root.iterdir()):
        if not d.is_dir() or d.name.startswith("."):
            continue
        problem = entry_problem(d)
        source = created = None
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            meta = json.loads((d / MARKER).read_text())
            source, created = meta.get("source"), meta.get("created")
        out.append(CacheEntry(d.name, d, source, _dir_size(d), problem is None, problem, created))
    return out


def discard_entry(entry_dir: Path) -> None:
    """Removes a cache entry (moved aside first, so no reader sees it half deleted)."""
    entry_dir = Path(entry_dir)
    if not entry_dir.exists():
        return
    trash = entry_dir.with_name(f".trash-{entry_dir.name}-{os.getpid()}-{time.time_ns()}")
    with contextlib.suppress(OSError):
        os.replace(entry_dir, trash)
        shutil.rmtree(trash, ignore_errors=True)
