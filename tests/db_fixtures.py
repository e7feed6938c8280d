"""Helpers of the jobs/store/runner tests (test_batchfile, test_store, test_runner, test_cli_jobs).

- ``FakeDecoder``: the Decoder interface without a model (deterministic text and stats; a prompt containing
  "FAIL" comes back as an error result, a chat message "BAD TEMPLATE" makes apply_chat_template raise).
- Database fixtures (import them into a test module to use them):
  ``pg_admin`` (session): a reachable PostgreSQL server's maintenance URL, or the test is skipped with why;
  ``pg_url`` (session): a fresh ``spec_batch_test_<random>`` database, migrated, dropped at the end;
  ``db_url`` (function, parametrized sqlite | postgresql): a migrated database URL of that backend;
  ``empty_db_url`` (function, parametrized): an empty database (for migrations).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from spec_batch.errors import ChatTemplateError
from spec_batch.core.outputs import GenerationResult, RequestStats

PG_HOST = os.environ.get("SPEC_BATCH_TEST_PG_HOST", "127.0.0.1")
PG_PORT = int(os.environ.get("SPEC_BATCH_TEST_PG_PORT", "5432"))
PG_USERS = [u for u in (os.environ.get("SPEC_BATCH_TEST_PG_USER"), "postgres", "root") if u]


# ---------------------------------------------------------------- fake decoder


class FakeDecoder:
    """Echoes the prompt: text = "ok:" + the prompt's first 12 characters; stats derived from the lengths."""

    def __init__(self, draft_name: str = "ngram", *, fail_after: int | None = None, delay_s: float = 0.0):
        self.target_name = "fake-target"
        self.draft_name = draft_name
        self.tokenizer = None
        self.fail_after = fail_after  # raise KeyboardInterrupt after this many results (a Ctrl-C)
        self.delay_s = delay_s
        self.calls: list[list] = []
        self.results_given = 0

    def apply_chat_template(self, messages: list[dict]) -> str:  # a real decoder returns token ids
        text = "|".join(f"{m['role']}:{m['content']}" for m in messages)
        if "BAD TEMPLATE" in text:
            raise ChatTemplateError("the fake chat template rejects 'BAD TEMPLATE'")
        return text

    def without_speculation(self) -> "FakeDecoder":
        d = FakeDecoder("none", delay_s=self.delay_s)
        return d

    def result_for(self, prompt, params) -> GenerationResult:
        text_in = prompt if isinstance(prompt, str) else " ".join(map(str, prompt))
        if "FAIL" in text_in:
            return GenerationResult("", [], "error", RequestStats(prompt_tokens=len(text_in)), error="prompt too long")
        n = min(params.max_new_tokens, 3 + len(text_in) % 5)
        speculative = self.draft_name != "none"
        stats = RequestStats(
            prompt_tokens=len(text_in),
            output_tokens=n,
            draft_tokens=2 * n if speculative else 0,
            accepted_tokens=n - 1 if speculative else 0,
            target_forwards=1 if speculative else n,
            draft_forwards=0,
            accepted_length_histogram=[0, 1] if speculative else [n],
            wall_s=0.01 * n,
        )
        return GenerationResult("ok:" + text_in[:12], list(range(n)), "length", stats)

    def generate(self, prompts, params, batch_size=8, *, return_errors=False, on_result=None):
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append(list(prompts))
        out = []
        for i, (p, sp) in enumerate(zip(prompts, params_list)):
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.fail_after is not None and self.results_given >= self.fail_after:
                raise KeyboardInterrupt
            res = self.result_for(p, sp)
            self.results_given += 1
            if on_result is not None:
                on_result(i, res)
            out.append(res)
        return out


def chat_line(cid: str, content: str, **body) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}}
    )


def completion_line(cid: str, prompt, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, **body}})


def write_batch(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


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
        except Exception as exc:  # noqa: BLE001
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
        capture_output=True, text=True, timeout=60,
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
            pytest.skip(f"PostgreSQL at {PG_HOST}:{PG_PORT} cannot be reached ({why}); starting it: {started or 'no output'}")
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
