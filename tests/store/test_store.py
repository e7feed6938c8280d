"""The SQL store on SQLite and PostgreSQL: migrations up and down, the schema, conditional updates, job_summary."""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import inspect, select, text
from sqlalchemy.exc import IntegrityError

from spec_batch.core.outputs import GenerationResult, RequestStats
from spec_batch.jobs import lifecycle
from spec_batch.jobs.stats import stats_by_model
from spec_batch.store import (
    JOB_SUMMARY_COLUMNS,
    DatabaseNotMigratedError,
    Job,
    Request,
    current_revision,
    downgrade,
    head_revision,
    make_engine,
    make_session_factory,
    migrate_to_head,
    open_store,
    queries,
    request_claims,
    summaries,
    utcnow,
)

REPO = Path(__file__).resolve().parents[2]
VIEW_COLUMNS = [
    "job_id",
    "status",
    "target",
    "drafter",
    "n_requests",
    "n_completed",
    "n_failed",
    "output_tokens",
    "acceptance_rate",
    "tokens_per_step",
    "tokens_per_s",
    "baseline_tokens_per_s",
    "speedup",
    "created_at",
    "completed_at",
    "forced_tokens",
    "speedup_low",
    "speedup_high",
    "speedup_reliable",
]


def _revisions() -> list[str]:
    """Every revision, base first."""
    from alembic.script import ScriptDirectory

    from spec_batch.store.db import _alembic_config

    script = ScriptDirectory.from_config(_alembic_config())
    return [r.revision for r in reversed(list(script.walk_revisions()))]


def _tables(engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version"}


def _views(engine) -> set[str]:
    return set(inspect(engine).get_view_names())


def test_migrations_up_and_down_from_empty(empty_db_url):
    engine = make_engine(empty_db_url)
    assert current_revision(engine) is None and _tables(engine) == set()
    revs = _revisions()
    assert revs[0] == "0001" and revs[-1] == head_revision()
    # one step at a time, up then down, then up again in one go
    from spec_batch.store.db import _run

    for rev in revs:
        _run(engine, "upgrade", rev)
        assert current_revision(engine) == rev
    assert {"jobs", "requests"} <= _tables(engine)
    assert "job_summary" in _views(engine)
    for i in range(len(revs) - 1, -1, -1):
        target = revs[i - 1] if i > 0 else "base"
        downgrade(engine, target)
        assert current_revision(engine) == (None if target == "base" else target)
    assert _tables(engine) == set() and _views(engine) == set()
    assert migrate_to_head(engine) == head_revision()
    assert migrate_to_head(engine) == head_revision()  # a no-op at head
    assert [c["name"] for c in inspect(engine).get_columns("job_summary")] == VIEW_COLUMNS
    engine.dispose()


def test_models_match_migrations(db_url):
    """The migrations create exactly what the SQLAlchemy models declare (autogenerate finds nothing)."""
    import importlib
    import pkgutil

    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    import spec_batch.store
    from spec_batch.store import Base

    for mod in pkgutil.iter_modules(spec_batch.store.__path__):
        importlib.import_module(f"spec_batch.store.{mod.name}")
    engine = make_engine(db_url)
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True, "compare_server_default": True})
        assert compare_metadata(ctx, Base.metadata) == []
    engine.dispose()


def test_view_columns_are_the_contract():
    assert list(JOB_SUMMARY_COLUMNS) == VIEW_COLUMNS


def test_plain_alembic_upgrade_head_uses_the_settings_url(tmp_path, monkeypatch):
    from alembic.config import main as alembic_main

    url = f"sqlite:///{tmp_path / 'cli.db'}"
    env = {**os.environ, "SPEC_BATCH_DATABASE_URL": url}
    proc = subprocess.run(
        [sys.executable, "-m", "alembic", "upgrade", "head"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr
    engine = make_engine(url)
    assert current_revision(engine) == head_revision() and "job_summary" in _views(engine)
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", url)
    alembic_main(argv=["-c", str(REPO / "alembic.ini"), "downgrade", "base"])
    assert current_revision(engine) is None and _tables(engine) == set()
    engine.dispose()


def test_sqlite_migrates_itself(tmp_path):
    factory = open_store(f"sqlite:///{tmp_path / 'sub' / 'auto.db'}")
    assert current_revision(factory.kw["bind"]) == head_revision()


@pytest.mark.postgres
def test_postgres_is_not_migrated_implicitly(pg_admin):
    from db_fixtures import create_pg_database, drop_pg_database

    url = create_pg_database(pg_admin)
    try:
        with pytest.raises(DatabaseNotMigratedError, match="spec-batch db upgrade"):
            open_store(url)
        open_store(url, migrate=True)
        assert current_revision(make_engine(url)) == head_revision()
    finally:
        drop_pg_database(url)


# ---------------------------------------------------------------- rows and conditional updates


def _new_job(factory, *, n: int = 3, baseline_sample: int = 0, **kw) -> tuple[str, list[int]]:
    job_id = "job_" + os.urandom(8).hex()
    with factory.begin() as s:
        s.add(
            Job(
                id=job_id,
                target="t",
                drafter="ngram",
                sampling_defaults={},
                n_requests=n,
                baseline_sample=baseline_sample,
                status="in_progress",
                **kw,
            )
        )
        for i in range(n):
            s.add(
                Request(
                    job_id=job_id,
                    custom_id=f"c{i}",
                    line_number=i + 1,
                    input="{}",
                    endpoint="/v1/completions",
                    prompt="p",
                    params={"max_new_tokens": 4},
                )
            )
    with factory() as s:
        return job_id, queries.request_ids(s, job_id)


def _result(out: int, draft: int, accepted: int, forwards: int, wall: float = 0.1, error: bool = False):
    stats = RequestStats(
        prompt_tokens=5,
        output_tokens=out,
        draft_tokens=draft,
        accepted_tokens=accepted,
        target_forwards=forwards,
        accepted_length_histogram=[1, 2],
        wall_s=wall,
    )
    if error:
        return GenerationResult("", [], "error", stats, error="prompt too long")
    return GenerationResult("x" * out, list(range(out)), "length", stats)


def test_defaults_timestamps_and_uniqueness(db_url):
    factory = make_session_factory(db_url)
    job_id, ids = _new_job(factory)
    with factory() as s:
        job = s.get(Job, job_id)
        req = s.get(Request, ids[0])
        assert job.created_at.tzinfo is not None and job.created_at.utcoffset() == timedelta(0)
        assert abs((utcnow() - job.created_at).total_seconds()) < 60
        assert (req.status, req.attempts, job.batch_size, job.decode_wall_s) == ("pending", 0, 8, 0.0)
    with pytest.raises(IntegrityError):  # custom_id is unique among a job's valid rows
        with factory.begin() as s:
            s.add(Request(job_id=job_id, custom_id="c0", line_number=99, input="{}", endpoint="/v1/completions"))
    with factory.begin() as s:  # an invalid line (no endpoint) keeps its custom_id, even one in use (0005)
        s.add(Request(job_id=job_id, custom_id="c0", line_number=98, input="{}", status="failed"))
    _other, _ = _new_job(factory, n=1)  # ... but not across jobs
    with pytest.raises(IntegrityError):  # status values are checked
        with factory.begin() as s:
            s.execute(text("UPDATE requests SET status = 'done' WHERE job_id = :j"), {"j": job_id})


def test_save_result_is_conditional_and_claims_respect_leases(db_url):
    factory = make_session_factory(db_url)
    job_id, ids = _new_job(factory, n=3)
    with factory.begin() as s:
        assert request_claims.claim_requests(s, job_id, ids[:2], worker="w1", lease_seconds=60) == ids[:2]
    with factory.begin() as s:  # a live lease is not claimable; a pending row is
        assert request_claims.claim_requests(s, job_id, ids, worker="w2", lease_seconds=60) == [ids[2]]
    with factory.begin() as s:  # an expired lease is
        s.execute(
            text("UPDATE requests SET lease_expires_at = :t WHERE id = :i"),
            {
                "t": (utcnow() - timedelta(seconds=5)).replace(tzinfo=None)
                if "sqlite" in db_url
                else utcnow() - timedelta(seconds=5),
                "i": ids[0],
            },
        )
    with factory.begin() as s:
        assert request_claims.claim_requests(s, job_id, ids, worker="w3", lease_seconds=60) == [ids[0]]
    with factory.begin() as s:
        assert queries.save_result(s, ids[0], _result(4, 6, 3, 2), worker="w3") is True
    with factory.begin() as s:
        assert queries.save_result(s, ids[0], _result(9, 9, 9, 9), worker="w1") is False  # stored once only
        assert queries.save_failure(s, ids[0], "x", "y") is False
    with factory() as s:
        r = s.get(Request, ids[0])
        assert (r.status, r.output_tokens, r.worker, r.attempts, r.lease_expires_at) == ("completed", 4, "w3", 1, None)
    with factory.begin() as s:
        assert queries.save_result(s, ids[1], _result(0, 0, 0, 0, error=True)) is True
        assert request_claims.release_requests(s, [ids[2]], worker="nobody") == 0
        assert request_claims.release_requests(s, [ids[2]], worker="w2") == 1
    with factory() as s:
        r = s.get(Request, ids[1])
        assert (r.status, r.error_code, r.error) == ("failed", "decode_error", "prompt too long")
        assert queries.job_counts(s, job_id) == {
            "pending": 1,
            "running": 0,
            "completed": 1,
            "failed": 1,
            "cancelled": 0,
        }


def test_finalize_exactly_once_and_only_when_done(db_url):
    factory = make_session_factory(db_url)
    job_id, ids = _new_job(factory, n=2)
    with factory.begin() as s:
        queries.save_result(s, ids[0], _result(3, 2, 1, 2))
        assert lifecycle.begin_finalizing(s, job_id) is False  # one request still pending
        queries.save_result(s, ids[1], _result(3, 2, 1, 2))
    with factory.begin() as s:
        assert lifecycle.begin_finalizing(s, job_id) is True
    with factory.begin() as s:
        assert lifecycle.begin_finalizing(s, job_id) is False
        assert lifecycle.complete(s, job_id) is True
        assert lifecycle.complete(s, job_id) is False
    with factory() as s:
        job = s.get(Job, job_id)
        assert job.status == "completed" and job.completed_at is not None and job.finalizing_at is not None


def test_cancel(db_url):
    factory = make_session_factory(db_url)
    job_id, ids = _new_job(factory, n=3)
    with factory.begin() as s:
        request_claims.claim_requests(s, job_id, ids[:1], worker="w", lease_seconds=60)
        assert lifecycle.request_cancel(s, job_id) is True
    with factory.begin() as s:
        assert lifecycle.settle_cancel(s, job_id) is False  # one is still running
    with factory.begin() as s:
        queries.save_result(s, ids[0], _result(2, 1, 1, 1))
        assert lifecycle.settle_cancel(s, job_id) is True
    with factory() as s:
        assert queries.get_job(s, job_id).status == "cancelled"
        assert queries.job_counts(s, job_id)["cancelled"] == 2


def test_resolve_job_id(db_url):
    factory = make_session_factory(db_url)
    job_id, _ = _new_job(factory, n=1)
    with factory() as s:
        assert queries.resolve_job_id(s, job_id) == job_id
        assert queries.resolve_job_id(s, job_id[:14]) == job_id
        with pytest.raises(queries.JobNotFoundError):
            queries.resolve_job_id(s, "job_nope")


# ---------------------------------------------------------------- job_summary


def test_job_summary_equals_the_sums_of_the_request_rows(db_url):
    factory = make_session_factory(db_url)
    job_id, ids = _new_job(factory, n=5)
    results = [
        _result(10, 12, 8, 3, wall=0.3),
        _result(7, 0, 0, 7, wall=0.2),
        _result(20, 30, 15, 6, wall=0.5),
        _result(0, 0, 0, 0, error=True),
    ]
    with factory.begin() as s:
        for rid, res in zip(ids, results):
            queries.save_result(s, rid, res)
        queries.add_decode_time(s, job_id, 1.5)
        queries.add_decode_time(s, job_id, 0.5)  # two runs add up
        queries.record_baseline(
            s,
            job_id,
            n_requests=2,
            baseline_output_tokens=30,
            baseline_wall_s=3.0,
            sample_output_tokens=30,
            sample_wall_s=1.2,
        )
        assert (
            queries.record_baseline(
                s,
                job_id,
                n_requests=1,
                baseline_output_tokens=1,
                baseline_wall_s=1.0,
                sample_output_tokens=1,
                sample_wall_s=1.0,
            )
            is False
        )  # first wins
    with factory() as s:
        row = summaries.job_summary_row(s, job_id)
        reqs = s.scalars(select(Request).where(Request.job_id == job_id)).all()
        job = s.get(Job, job_id)
    out = sum(r.output_tokens or 0 for r in reqs)
    assert row["n_requests"] == len(reqs) == 5
    assert row["n_completed"] == sum(r.status == "completed" for r in reqs) == 3
    assert row["n_failed"] == sum(r.status == "failed" for r in reqs) == 1
    assert row["output_tokens"] == out == 37
    assert row["acceptance_rate"] == pytest.approx(
        sum(r.accepted_tokens or 0 for r in reqs) / sum(r.draft_tokens or 0 for r in reqs)
    )
    assert row["tokens_per_step"] == pytest.approx(out / sum(r.target_forwards or 0 for r in reqs))
    assert row["tokens_per_s"] == pytest.approx(out / job.decode_wall_s) and job.decode_wall_s == pytest.approx(2.0)
    assert row["baseline_tokens_per_s"] == pytest.approx(10.0)
    assert row["speedup"] == pytest.approx((30 / 1.2) / (30 / 3.0))
    assert (row["status"], row["target"], row["drafter"]) == ("in_progress", "t", "ngram")
    assert row["created_at"].tzinfo is not None and row["completed_at"] is None
    assert isinstance(row["acceptance_rate"], float) and isinstance(row["n_requests"], int)


def test_job_summary_nulls_instead_of_division_by_zero(db_url):
    factory = make_session_factory(db_url)
    empty, _ = _new_job(factory, n=0)
    job_id, ids = _new_job(factory, n=1)
    with factory.begin() as s:
        queries.save_result(s, ids[0], _result(0, 0, 0, 0, error=True))
    with factory() as s:
        for jid in (empty, job_id):
            row = summaries.job_summary_row(s, jid)
            assert row["output_tokens"] == 0
            for col in ("acceptance_rate", "tokens_per_step", "tokens_per_s", "baseline_tokens_per_s", "speedup"):
                assert row[col] is None, col
        assert summaries.job_summary_row(s, empty)["n_requests"] == 0
        listed = summaries.list_job_summaries(s, limit=None)
        assert {empty, job_id} <= {r["job_id"] for r in listed}
    stats = stats_by_model(factory)
    mine = next(r for r in stats if r["target"] == "t" and r["drafter"] == "ngram")
    assert mine["acceptance_rate"] is None or mine["draft_tokens"] > 0


def test_readme_sql_runs(db_url):
    """The SQL shown in the README and the jobs guide runs on this backend."""
    import re

    doc = "\n".join((REPO / name).read_text(encoding="utf-8") for name in ("README.md", "docs/jobs.md"))
    blocks = re.findall(r"```sql\n(.*?)```", doc, flags=re.S)
    assert len(blocks) >= 3
    dialect = "postgresql" if db_url.startswith("postgresql") else "sqlite"
    factory = make_session_factory(db_url)
    _new_job(factory, n=1)
    ran = 0
    for block in blocks:
        first = block.strip().splitlines()[0].lower()
        if ("postgresql only" in first and dialect != "postgresql") or ("sqlite only" in first and dialect != "sqlite"):
            continue
        with factory() as s:
            s.execute(text(block)).all()
            ran += 1
    assert ran >= 3
