"""Alembic environment: metadata from the app, URL from settings (or a connection handed in by the app).

`render_as_batch=True` so ALTERs on SQLite are done by table copy.
"""

from __future__ import annotations

import importlib
import pkgutil
from logging.config import fileConfig

from alembic import context

import spec_batch.store
from spec_batch.settings import get_settings
from spec_batch.store.db import make_engine, normalize_url
from spec_batch.store.models import Base

# Every module of spec_batch.store that declares tables (models, queue, ...) adds them to Base.metadata.
for _mod in pkgutil.iter_modules(spec_batch.store.__path__):
    importlib.import_module(f"spec_batch.store.{_mod.name}")

config = context.config
if config.config_file_name is not None and config.attributes.get("connection") is None:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    return normalize_url(config.get_main_option("sqlalchemy.url") or get_settings().database_url)


def run_migrations_offline() -> None:
    context.configure(
        url=_url(),
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_with(connection) -> None:
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:  # spec_batch.store.migrate_to_head / downgrade
        _run_with(connection)
        return
    engine = make_engine(_url())
    try:
        with engine.begin() as conn:
            _run_with(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
