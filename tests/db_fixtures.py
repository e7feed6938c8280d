"""Database fixtures of the jobs, store, CLI and worker tests (a pytest plugin: tests/conftest.py loads it).

- ``pg_admin`` (session): a reachable PostgreSQL server's maintenance URL, or the test is skipped with why;
  ``pg_url`` (session): a fresh ``spec_batch_test_<random>`` database, migrated, dropped at the end;
  ``db_url`` (function, parametrized sqlite | postgresql): a migrated database URL of that backend;
  ``empty_db_url`` (function, parametrized): an empty database (for migrations).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

PG_HOST = os.environ.get("SPEC_BATCH_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("SPEC_BATCH_TEST_PG_PORT", "5432"))
PG_USERS = [u for u in (os.environ.get("SPEC_BATCH_TEST_PG_USER"), "postgres", "root") if u]


# ---------------------------------------------------------------- PostgreSQL


def _try_connect(user: str, dbname: str = "postgres"):
    import psycopg

    return psycopg.connect(host=PG_HOST, port=PG_PORT, user=user, dbname=dbname, connect_timeout=3, autocommit=True)


def _find_pg_user() -> tuple[str | None, str]:
    last = ""
    for user in PG_USERS:
        try:
            with _try_connect(user):
                return user, ""
        except Exception as exc:
            last = f"{type(exc).__name__}: {exc}".strip()
    return None, last


def _start_pg() -> str:
    if not shutil.which("pg_ctlcluster") or not Path("/etc/postgresql").is_dir():
        return "pg_ctlcluster is not installed"
    versions = sorted(os.listdir("/etc/postgresql"))
    if not versions:
        return "no cluster in /etc/postgresql"
    proc = subprocess.run(
        ["pg_ctlcluster", "--skip-systemctl-redirect", versions[-1], "main", "start"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return (proc.stderr or proc.stdout).strip()


@pytest.fixture(scope="session")
def pg_admin() -> str:
    user, why = _find_pg_user()
    if user is None:
        started = _start_pg()
        for _ in range(20):
            user, why = _find_pg_user()
            if user is not None:
                break
            time.sleep(0.5)
        if user is None:
            pytest.skip(
                f"PostgreSQL at {PG_HOST}:{PG_PORT} cannot be reached ({why}); starting it: {started or 'no output'}"
            )
    return f"postgresql+psycopg://{user}@{PG_HOST}:{PG_PORT}/postgres"


def create_pg_database(admin_url: str) -> str:
    from sqlalchemy.engine import make_url

    url = make_url(admin_url)
    name = f"spec_batch_test_{uuid.uuid4().hex[:12]}"
    with _try_connect(url.username) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.set(database=name).render_as_string(hide_password=False)


def drop_pg_database(db_url: str) -> None:
    from sqlalchemy.engine import make_url

    url = make_url(db_url)
    with _try_connect(url.username) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{url.database}" WITH (FORCE)')


@pytest.fixture(scope="session")
def pg_url(pg_admin):
    from spec_batch.store import migrate_to_head

    url = create_pg_database(pg_admin)
    migrate_to_head(url)
    yield url
    drop_pg_database(url)  # WITH (FORCE): connections the tests' engines still hold are closed


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        from spec_batch.store import migrate_to_head

        url = f"sqlite:///{tmp_path / 'jobs.db'}"
        migrate_to_head(url)
        return url
    return request.getfixturevalue("pg_url")


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_db_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    admin = request.getfixturevalue("pg_admin")
    url = create_pg_database(admin)
    yield url
    drop_pg_database(url)
