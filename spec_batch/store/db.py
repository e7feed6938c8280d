"""Engines, session factories and migrations.

SQLite (the embedded default: a file in the working directory) migrates itself on open; a server database
(PostgreSQL, by URL, psycopg 3) is migrated explicitly with ``spec-batch db upgrade`` or ``alembic upgrade head``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import tempfile
from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from ..errors import SpecBatchError
from ..settings import get_settings, shown_url

# The repository's migrations/ (spec-batch is installed editable: see scripts/setup.sh).
MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"


class DatabaseNotMigratedError(SpecBatchError):
    """A server database whose schema is not at the migrations' head."""


class DatabaseMissingError(SpecBatchError):
    """A SQLite file that does not exist, opened by a command that only reads."""


def sqlite_path(url: str) -> Path | None:
    """The file of a SQLite URL (None for another backend or an in-memory database)."""
    url = normalize_url(url)
    if not url.startswith("sqlite"):
        return None
    path = make_url(url).database
    return Path(path).expanduser() if path and path != ":memory:" else None


def normalize_url(url: str) -> str:
    """postgresql:// and postgres:// use psycopg 3 (the only PostgreSQL driver spec-batch installs)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    if url.startswith("postgresql://"):
        url = "postgresql+psycopg://" + url[len("postgresql://") :]
    return url


def _sqlite_pragmas(dbapi_connection, _record) -> None:
    cur = dbapi_connection.cursor()
    cur.execute("PRAGMA foreign_keys=ON")
    cur.execute("PRAGMA busy_timeout=30000")  # a second process (resume, a reader) waits instead of failing
    cur.execute("PRAGMA journal_mode=WAL")  # readers do not block the writer storing results
    cur.execute("PRAGMA synchronous=NORMAL")
    cur.close()


def make_engine(url: str | None = None, *, create: bool = True, **kwargs) -> Engine:
    """An engine for `url`. create=False: a SQLite file that does not exist raises DatabaseMissingError (nothing
    is created); create=True makes its folder."""
    url = normalize_url(url or get_settings().database_url)
    path = sqlite_path(url)
    if path is not None:
        if not create and not path.exists():
            raise DatabaseMissingError(
                f"the database {path} does not exist (no job has been run with this database yet; "
                f"`spec-batch run FILE.jsonl` creates it, SPEC_BATCH_DATABASE_URL names another one)"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
    if url.startswith("sqlite"):
        kwargs.setdefault("connect_args", {"timeout": 30})
    else:
        kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(url, **kwargs)
    if engine.dialect.name == "sqlite":
        event.listen(engine, "connect", _sqlite_pragmas)
    return engine


def make_session_factory(engine: Engine | str | None = None) -> sessionmaker[Session]:
    if not isinstance(engine, Engine):
        engine = make_engine(engine)
    return sessionmaker(engine, expire_on_commit=False)


def _alembic_config(engine_url: str | None = None):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    if engine_url:
        cfg.set_main_option("sqlalchemy.url", engine_url.replace("%", "%%"))
    return cfg


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    heads = ScriptDirectory.from_config(_alembic_config()).get_heads()
    if len(heads) != 1:
        raise RuntimeError(f"migrations/ has {len(heads)} heads {heads}; merge them")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


@contextlib.contextmanager
def _migration_lock(engine: Engine):
    """Serializes migrations of one SQLite file across processes (workers starting together)."""
    path = engine.url.database if engine.dialect.name == "sqlite" else None
    if not path or path == ":memory:":
        yield
        return
    digest = hashlib.sha1(str(Path(path).expanduser().resolve()).encode()).hexdigest()[:16]
    lock_path = Path(tempfile.gettempdir()) / f"spec-batch-migrate-{digest}.lock"  # not beside the db: no litter
    with open(lock_path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _run(engine: Engine, fn_name: str, revision: str) -> None:
    from alembic import command

    cfg = _alembic_config()
    with _migration_lock(engine), engine.begin() as conn:
        cfg.attributes["connection"] = conn  # env.py uses this connection instead of settings' URL
        getattr(command, fn_name)(cfg, revision)


def migrate_to_head(url_or_engine: Engine | str | None = None) -> str:
    """Upgrades the database to the newest migration (a no-op when it is there). Returns the revision."""
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
    head = head_revision()
    if current_revision(engine) != head:
        _run(engine, "upgrade", "head")
    return head


def downgrade(url_or_engine: Engine | str | None, revision: str) -> None:
    """Downgrades to `revision` ("base" drops every table and the view)."""
    engine = url_or_engine if isinstance(url_or_engine, Engine) else make_engine(url_or_engine)
    _run(engine, "downgrade", revision)


def open_store(url: str | None = None, *, migrate: bool | None = None, create: bool = True) -> sessionmaker[Session]:
    """A session factory for `url` (default: $SPEC_BATCH_DATABASE_URL or sqlite:///spec_batch.db).

    migrate=None: SQLite migrates itself; a server must already be at head (clear error otherwise).
    create=False: a missing SQLite file is an error (DatabaseMissingError), not a new empty database.
    """
    engine = make_engine(url, create=create)
    if migrate is None:
        migrate = engine.dialect.name == "sqlite"
    if migrate:
        migrate_to_head(engine)
    else:
        cur, head = current_revision(engine), head_revision()
        if cur != head:
            shown = shown_url(engine.url.render_as_string(hide_password=False))
            raise DatabaseNotMigratedError(
                f"database {shown} is at revision {cur or '(empty)'}, the code needs {head}: "
                f"run `spec-batch db upgrade` (or `alembic upgrade head`) with SPEC_BATCH_DATABASE_URL set"
            )
    return make_session_factory(engine)


__all__ = [
    "MIGRATIONS_DIR",
    "DatabaseMissingError",
    "DatabaseNotMigratedError",
    "current_revision",
    "downgrade",
    "head_revision",
    "make_engine",
    "make_session_factory",
    "migrate_to_head",
    "normalize_url",
    "open_store",
    "sqlite_path",
]
