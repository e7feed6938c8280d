"""Draft heads by name: `head:NAME` (a head stored in SQL, table `drafters`) becomes `head:/local/dir`, the form
the loading layer reads (it never reads SQL). The weights are written once per content hash under the cache
directory, so a worker on another machine loads a head by name, like a model, and later loads are local.

`head:/path/dir` (a directory that exists) and every other drafter name pass through unchanged, as do the
hybrid form `hybrid:NAME` / `hybrid:/path/dir` (suffix drafting where it is confident, the head elsewhere).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from ..errors import InvalidParameterError
from ..store.drafters import DraftHead, get_drafter

HEAD_KINDS = ("head:", "hybrid:")


def split_head(draft: Any) -> tuple[str, str] | None:
    """('head:' | 'hybrid:', the rest) for a head drafter's name, else None."""
    if isinstance(draft, str):
        for kind in HEAD_KINDS:
            if draft.startswith(kind) and len(draft) > len(kind):
                return kind, draft[len(kind) :]
    return None


def resolve_draft(draft: Any, session_factory: Callable[[], sessionmaker[Session]], cache_dir: str | Path) -> Any:
    """draft with a stored head's name replaced by its local directory. session_factory is called only when a
    name must be looked up (drafters without a head never open the database)."""
    parts = split_head(draft)
    if parts is None or Path(os.path.expanduser(parts[1])).is_dir():
        return draft
    kind, name = parts
    with session_factory()() as s:
        row = get_drafter(s, name)
        if row is None:
            raise InvalidParameterError(
                f"draft {draft!r}: no head named {name!r} in the database and no such directory; "
                "`spec-batch drafters list` shows the stored heads, `spec-batch drafters train` makes one"
            )
        return f"{kind}{materialize(row, cache_dir)}"


def materialize(row: DraftHead, cache_dir: str | Path) -> Path:
    """The head's directory under cache_dir/heads (written atomically once per weights hash)."""
    import json

    out = Path(cache_dir).expanduser() / "heads" / f"{_safe(row.name)}-{row.sha256[:16]}"
    if (out / "model.safetensors").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-"))
    (tmp / "config.json").write_text(json.dumps(row.config, indent=2, sort_keys=True))
    (tmp / "model.safetensors").write_bytes(row.weights)
    try:
        tmp.rename(out)
    except OSError:  # another process wrote it first: theirs is the same content
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "head"


def resolve_with_settings(draft: Any, settings: Any = None) -> Any:
    """`resolve_draft` against the configured database and cache directory (the CLI's, a worker's)."""
    from ..settings import get_settings
    from ..store import open_store

    s = settings or get_settings()
    if split_head(draft) is None:
        return draft

    def factory() -> sessionmaker[Session]:  # one engine per database for the process (workers resolve per job)
        if s.database_url not in _FACTORIES:
            _FACTORIES[s.database_url] = open_store(s.database_url)
        return _FACTORIES[s.database_url]

    return resolve_draft(draft, factory, s.cache_dir)


_FACTORIES: dict[str, sessionmaker[Session]] = {}
