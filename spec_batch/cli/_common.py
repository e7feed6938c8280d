"""Helpers shared by the `spec-batch` command modules: opening the store, naming a job, --metadata."""
from __future__ import annotations

import click


def open_store_or_exit():
    """The session factory for the configured database, or a clean CLI error naming it."""
    from ..errors import SpecBatchError
    from ..settings import get_settings
    from ..store import open_store

    try:
        return open_store()
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001  (a server that cannot be reached, a bad URL)
        from sqlalchemy.engine import make_url

        try:
            shown = make_url(get_settings().database_url).render_as_string(hide_password=True)
        except Exception:  # noqa: BLE001
            shown = "SPEC_BATCH_DATABASE_URL"
        raise click.ClickException(f"cannot open the database {shown}: {exc}") from exc


def resolve_job(factory, ref: str) -> str:
    """A job id from an id, a unique prefix or "latest", or a clean CLI error."""
    from ..store import queries

    try:
        with factory() as s:
            return queries.resolve_job_id(s, ref)
    except queries.JobNotFoundError as exc:
        raise click.ClickException(str(exc)) from exc


def parse_metadata(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """`--metadata KEY=VALUE` options as a dict; a malformed one is a usage error naming it."""
    meta: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--metadata")
        meta[key] = value
    return meta
