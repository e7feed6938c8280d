"""`spec-batch models`: the built-in model aliases and the GGUF conversion cache."""

from __future__ import annotations

import datetime as _dt
import json
import sys
from pathlib import Path

import click

from ._group import main


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if size < 1000 or unit == "TB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    return f"{n} B"  # pragma: no cover


@main.command("models")
@click.option(
    "--cache-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Cache directory to list (default: $SPEC_BATCH_CACHE or the user cache dir).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
def models_command(cache_dir: Path | None, as_json: bool) -> None:
    """List the built-in model aliases (where their files are, whether installed) and the model cache.

    Besides the aliases, a model can be named by a local .gguf file, a local Hugging Face model
    directory, or a hub id ('org/name') already in the local hub cache.
    """
    from ..loading.gguf_cache import cache_root
    from ..loading.load import list_cache
    from ..loading.resolve import alias_info

    aliases = alias_info()
    root = cache_root(cache_dir)
    entries = list_cache(cache_dir)
    if as_json:
        click.echo(json.dumps(_as_json(aliases, root, entries), indent=2))
        return

    from rich.console import Console

    # On a terminal, fit its width; piped or captured, do not fold paths (tables are only as wide as their text).
    console = Console(width=None if sys.stdout.isatty() else 250)
    console.print(_alias_table(aliases))
    if entries:
        console.print(_cache_table(root, entries))
        total = sum(e.size_bytes for e in entries)
        console.print(f"{len(entries)} cache entr{'y' if len(entries) == 1 else 'ies'}, {_human(total)} in all")
    else:
        console.print(f"Converted GGUF cache: {root}: empty (a GGUF model is converted on first load)")


def _as_json(aliases, root: Path, entries) -> dict:
    return {
        "aliases": [
            {
                "name": a.name,
                "description": a.description,
                "package": a.distribution,
                "path": str(a.path) if a.path else None,
                "installed": a.installed,
                "install_command": a.install_command,
            }
            for a in aliases
        ],
        "cache_dir": str(root),
        "cache": [
            {
                "key": e.key,
                "path": str(e.path),
                "source": e.source,
                "size_bytes": e.size_bytes,
                "valid": e.valid,
                "problem": e.problem,
                "created": e.created,
            }
            for e in entries
        ],
    }


def _alias_table(aliases):
    from rich.table import Table

    table = Table(title="Built-in models", title_justify="left")
    for col in ("alias", "model", "package", "installed", "file"):
        table.add_column(col, overflow="fold")
    for a in aliases:
        table.add_row(
            a.name,
            a.description,
            a.distribution,
            "yes" if a.installed else "no",
            str(a.path) if a.path else f"not installed: {a.install_command}",
        )
    return table


def _cache_table(root: Path, entries):
    from rich.table import Table

    table = Table(title=f"Converted GGUF cache: {root}", title_justify="left")
    for col in ("entry", "size", "status", "converted from", "created"):
        table.add_column(col, overflow="fold")
    for e in entries:
        created = _dt.datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M") if e.created else "-"
        status = "ok" if e.valid else f"incomplete, rebuilt on next load ({e.problem})"
        table.add_row(e.key, _human(e.size_bytes), status, e.source or "-", created)
    return table
