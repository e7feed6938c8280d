"""The SQL of files and batches (store/files.py, migration 0008_files) on SQLite and PostgreSQL: uploads in
chunks with their limits, owners, pages, batches created from a stored file, and the migration's downgrade."""

from __future__ import annotations

import io
import json
import uuid

import pytest
from sqlalchemy import inspect

from spec_batch.server.batch_create import JobFields, create_batch
from spec_batch.server.errors import APIError
from spec_batch.server.file_io import iter_content, store_upload
from spec_batch.store import downgrade, make_engine, make_session_factory, migrate_to_head, queries
from spec_batch.store import files as file_sql
from spec_batch.store.file_tables import CHUNK_BYTES

FIELDS = JobFields(target="fake", drafter="ngram")


@pytest.fixture
def factory(db_url):
    f = make_session_factory(db_url)
    yield f
    f.kw["bind"].dispose()


def _upload(factory, data: bytes, owner: str | None = "o1", **limits) -> str:
    limits = {"max_bytes": 10 * CHUNK_BYTES, "max_lines": 1000, **limits}
    return store_upload(factory, io.BytesIO(data), owner=owner, filename="in.jsonl", purpose="batch", **limits)


def _line(cid: str, url: str = "/v1/completions", **body) -> str:
    return json.dumps(
        {"custom_id": cid, "method": "POST", "url": url, "body": {"prompt": "hello", "max_tokens": 4, **body}}
    )


def test_a_file_is_stored_in_chunks_and_read_back_whole(factory):
    data = (b"x" * 999 + b"\n") * (CHUNK_BYTES * 5 // 2 // 1000) + b"last line without a newline"
    file_id = _upload(factory, data, max_lines=10_000)
    with factory() as s:
        row = file_sql.get_file(s, file_id, "o1")
        assert (row.bytes, row.line_count) == (len(data), data.count(b"\n") + 1)
        assert len(list(file_sql.iter_chunks(s, file_id))) == 3
    assert b"".join(iter_content(factory, file_id)) == data


@pytest.mark.parametrize("limit", [{"max_bytes": CHUNK_BYTES + 10}, {"max_lines": 5}])
def test_an_upload_over_a_limit_is_a_413_and_stores_nothing(factory, limit):
    owner = f"o-{uuid.uuid4().hex}"
    with pytest.raises(APIError) as info:
        _upload(factory, b"line\n" * (CHUNK_BYTES // 2), owner=owner, **limit)
    assert info.value.status == 413
    with factory() as s:
        assert file_sql.list_files(s, owner) == []


def test_owners_see_only_their_files_and_pages_go_newest_first(factory):
    o1 = f"o1-{uuid.uuid4().hex}"  # PostgreSQL's database is shared by the session's tests
    ids = [_upload(factory, b"a\n", owner=o1) for _ in range(3)]
    other = _upload(factory, b"b\n", owner="o2")
    with factory() as s:
        assert [f.id for f in file_sql.list_files(s, o1)] == ids[::-1]
        assert [f.id for f in file_sql.list_files(s, o1, after=ids[2], limit=1)] == [ids[1]]
        assert file_sql.list_files(s, o1, after=other) == []  # another owner's cursor is no cursor
        assert file_sql.get_file(s, other, o1) is None and file_sql.get_file(s, other, None) is not None
    with factory.begin() as s:
        assert not file_sql.delete_file(s, other, o1)
        assert file_sql.delete_file(s, ids[0], o1)
    with factory() as s:
        assert file_sql.get_file(s, ids[0], None) is None and list(file_sql.iter_chunks(s, ids[0])) == []


def test_a_batch_is_a_job_of_the_stored_file(factory):
    file_id = _upload(factory, "\n".join([_line("a"), _line("b", temperature=9), _line("c")]).encode())
    batch_id = create_batch(
        factory,
        input_file_id=file_id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata={"k": "v"},
        owner="o1",
        fields=FIELDS,
        max_line_bytes=1 << 20,
        max_lines=10,
    )
    with factory() as s:
        batch, job = file_sql.get_batch(s, batch_id, "o1")
        assert job.status == "in_progress" and job.input_file == file_id and job.user_metadata == {"k": "v"}
        assert queries.job_counts(s, batch_id)["pending"] == 2 and queries.job_counts(s, batch_id)["failed"] == 1
        assert batch.errors is None and file_sql.get_batch(s, batch_id, "o2") is None
        assert batch_id in file_sql.local_batches_to_run(s)
        assert batch_id in [b.id for b, _ in file_sql.list_batches(s, "o1")]


def test_a_malformed_file_fails_its_batch_with_every_line_named(factory):
    lines = [_line("a"), "[1]", _line("a"), _line("d", url="/v1/chat/completions"), '{"url": "/v1/completions"}']
    file_id = _upload(factory, "\n".join(lines).encode())
    batch_id = create_batch(
        factory,
        input_file_id=file_id,
        endpoint="/v1/completions",
        completion_window="24h",
        metadata=None,
        owner=None,
        fields=FIELDS,
        max_line_bytes=1 << 20,
        max_lines=10,
    )
    with factory() as s:
        batch, job = file_sql.get_batch(s, batch_id, None)
        assert job.status == "failed" and "failed validation" in job.error
        assert [(e["line"], e["code"]) for e in batch.errors] == [
            (2, "invalid_line"),
            (3, "duplicate_custom_id"),
            (4, "invalid_url"),
            (5, "missing_custom_id"),
        ]
        assert queries.job_counts(s, batch_id)["pending"] == 0 and batch_id not in file_sql.local_batches_to_run(s)


def test_migration_0008_downgrades_and_upgrades_again(db_url):
    engine = make_engine(db_url)
    downgrade(engine, "0007_job_weights")
    assert not {"files", "file_chunks", "batches"} & set(inspect(engine).get_table_names())
    migrate_to_head(engine)
    assert {"files", "file_chunks", "batches"} <= set(inspect(engine).get_table_names())
    engine.dispose()


def test_a_server_runs_only_the_batches_made_for_its_models_and_precision(factory):
    """Two servers on one database: each runner lists only its own kind of batch (issue 38, defect 1)."""
    made = {}
    for name, fields in {
        "ngram": FIELDS,
        "none": JobFields(target="fake", drafter="none"),
        "int4": JobFields(target="fake", drafter="ngram", weights="int4", dtype="float32"),
        "other": JobFields(target="other-model", drafter="ngram"),
    }.items():
        file_id = _upload(factory, _line("a").encode())
        made[name] = create_batch(
            factory,
            input_file_id=file_id,
            endpoint="/v1/completions",
            completion_window="24h",
            metadata=None,
            owner="o1",
            fields=fields,
            max_line_bytes=1 << 20,
            max_lines=10,
        )
    with factory() as s:

        def runs(*fields: str | None) -> set[str]:
            return set(file_sql.local_batches_to_run(s, *fields)) & set(made.values())

        assert runs("fake", "ngram", "full", "float32") == {made["ngram"]}
        assert runs("fake", "none", "full", "float32") == {made["none"]}
        assert runs("fake", "ngram", "int4", "float32") == {made["int4"]}
        assert runs("fake", "ngram", "int4", "bfloat16") == set()
        assert runs("other-model", "ngram", "full", "float32") == {made["other"]}
        assert runs() == set(made.values())  # no server's fields: every local batch (the CLI's view)
