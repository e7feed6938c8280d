"""`spec-batch db upgrade | current | downgrade`: the job database's schema (Alembic migrations); `db prune`: retention."""

from __future__ import annotations

import click

from ..errors import SpecBatchError
from ._group import main, mask_in_errors


@main.group("db")
def db_group() -> None:
    """The job database's schema (Alembic migrations). URL: $SPEC_BATCH_DATABASE_URL."""


def _engine(url: str | None, *, create: bool = True):
    from ..store import make_engine

    mask_in_errors(click.get_current_context(), url)
    try:
        return make_engine(url, create=create)
    except SpecBatchError as exc:
        raise click.ClickException(str(exc)) from exc


@db_group.command("upgrade")
@click.option(
    "--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL or sqlite:///spec_batch.db)."
)
def db_upgrade(url: str | None) -> None:
    """Migrate the database to the newest schema (what `alembic upgrade head` does)."""
    from ..settings import shown_url
    from ..store import current_revision, migrate_to_head

    engine = _engine(url)
    shown = shown_url(engine.url.render_as_string(hide_password=False))
    try:
        before = current_revision(engine)
        head = migrate_to_head(engine)
    except Exception as exc:
        raise click.ClickException(f"cannot migrate {shown}: {exc}") from exc
    click.echo(f"{shown}: {before or '(empty)'} -> {head}" if before != head else f"{shown}: already at {head}")


@db_group.command("current")
@click.option("--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL).")
def db_current(url: str | None) -> None:
    """Show the database's revision and the newest one."""
    from ..store import current_revision, head_revision

    engine = _engine(url, create=False)
    click.echo(f"current: {current_revision(engine) or '(empty)'}  head: {head_revision()}")


@db_group.command("downgrade")
@click.argument("revision")
@click.option("--url", default=None, help="Database URL (default: $SPEC_BATCH_DATABASE_URL).")
@click.confirmation_option(prompt="Downgrading drops tables and their data. Continue?")
def db_downgrade(revision: str, url: str | None) -> None:
    """Downgrade the schema to REVISION ("base" drops everything spec-batch created)."""
    from ..store import downgrade

    downgrade(_engine(url, create=False), revision)
    click.echo(f"downgraded to {revision}")


@db_group.command("prune")
@click.option(
    "--older-than",
    "days",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    metavar="DAYS",
    help="Delete what is older than DAYS days (default: $SPEC_BATCH_RETENTION_DAYS).",
)
def db_prune(days: float | None) -> None:
    """Retention: delete the API's uploaded files and ended batches (with their jobs and results) created more than
    DAYS days ago. Jobs of `run` and `submit` are kept. `spec-batch serve` does the same once an hour when
    SPEC_BATCH_RETENTION_DAYS is set."""
    from datetime import timedelta

    from ..settings import get_settings
    from ..store import files
    from ..store.models import utcnow
    from ._common import open_store_or_exit

    days = days if days is not None else get_settings().retention_days
    if days is None:
        raise click.ClickException("no retention is set: pass --older-than DAYS or set SPEC_BATCH_RETENTION_DAYS")
    session_factory = open_store_or_exit(must_exist=True)
    with session_factory.begin() as s:
        pruned = files.prune_before(s, utcnow() - timedelta(days=days))
    click.echo(f"deleted {pruned.files} files and {pruned.batches} batches older than {days:g} days")
