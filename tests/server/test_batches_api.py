"""The Files and Batches API with the official `openai` client against a real uvicorn server process (local
runner, the real default model with the n-gram drafter, SQLite, two bearer keys).

Outputs are compared with `spec-batch run` on the same file: every output line is run's (texts, finish reasons,
token counts, errors), except the ids of rows, `created`, and the values of `usage.speculative`: the adaptive
draft policy picks draft lengths from measured step costs, so even two `spec-batch run`s of one file draft
differently (the greedy texts are the same).
"""

from __future__ import annotations

import time

import openai
import pytest
from batch_testlib import ApiServer, api_env, chat_line, jsonl, run_cli, wait_batch, write_lines

from spec_batch.server.auth import owner_hash
from spec_batch.store import files as file_sql
from spec_batch.store import make_session_factory

pytestmark = pytest.mark.slow

MAX_LINES = 40
MAX_BYTES = 100_000


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("api")
    env = api_env(
        SPEC_BATCH_API_KEYS="key-a,key-b",
        SPEC_BATCH_API_MAX_FILE_LINES=str(MAX_LINES),
        SPEC_BATCH_API_MAX_FILE_BYTES=str(MAX_BYTES),
    )
    srv = ApiServer(f"sqlite:///{d / 'api.db'}", d, env).start()
    yield srv
    srv.stop()


def _timeless(line: dict) -> dict:
    """An output or error line without what differs between two runs of the same request."""
    line = {k: v for k, v in line.items() if k != "id"}
    response = line.get("response")
    if response:
        response = {k: v for k, v in response.items() if k != "request_id"}
        body = dict(response["body"])
        body.pop("id", None), body.pop("created", None)
        if "usage" in body:
            spec = body["usage"]["speculative"]
            spec = {"drafter": spec["drafter"], "fields": sorted(spec)}
            body["usage"] = {**body["usage"], "speculative": spec}
        response["body"] = body
        line["response"] = response
    return line


def test_a_batch_runs_and_its_files_are_spec_batch_runs(server, tmp_path):
    lines = [
        chat_line("greet", "Say hello to Ada."),
        chat_line("count", "Count from one to five."),
        chat_line("bad", "Hi", temperature=9),
        chat_line("fruit", "Name three fruits."),
    ]
    path = write_lines(tmp_path / "in.jsonl", lines)
    client = server.client()
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    assert uploaded.bytes == path.stat().st_size and uploaded.purpose == "batch"
    assert client.files.content(uploaded.id).read() == path.read_bytes()
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"team": "docs"}
    )
    assert batch.status in ("validating", "in_progress") and batch.metadata == {"team": "docs"}
    batch = wait_batch(client, batch.id)
    assert batch.status == "completed", server.log()
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (4, 3, 1)
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    spec = batch.model_extra["speculative"]
    assert spec["drafter"] == "ngram" and spec["output_tokens"] > 0 and spec["speedup"] is not None
    outputs = jsonl(client.files.content(batch.output_file_id).text)
    errors = jsonl(client.files.content(batch.error_file_id).text)
    assert [o["custom_id"] for o in outputs] == ["greet", "count", "fruit"]
    assert [e["custom_id"] for e in errors] == ["bad"] and errors[0]["error"]["line"] == 3
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"
    assert client.files.delete(batch.output_file_id).deleted  # it no longer resolves (docs/batch-api.md)
    with pytest.raises(openai.NotFoundError):
        client.files.content(batch.output_file_id)

    out = tmp_path / "run.jsonl"
    proc = run_cli(
        "run",
        str(path),
        "-o",
        str(out),
        "--draft",
        "ngram",
        env=api_env(SPEC_BATCH_DATABASE_URL=(f"sqlite:///{tmp_path / 'run.db'}")),
    )
    assert proc.returncode == 0, proc.stderr
    assert [_timeless(x) for x in outputs] == [_timeless(x) for x in jsonl(out.read_text())]
    run_errors = jsonl((tmp_path / "run.errors.jsonl").read_text())
    assert [_timeless(x) for x in errors] == [_timeless(x) for x in run_errors]
    report = server.client()._client.get(
        f"{server.base_url}/batches/{batch.id}/report", headers={"Authorization": "Bearer key-a"}
    )
    assert report.status_code == 200 and batch.id in report.text


def test_a_malformed_file_fails_while_validating_naming_each_line(server, tmp_path):
    lines = [
        chat_line("ok", "Hi"),
        "{not json",
        '{"method": "POST", "url": "/v1/chat/completions", "body": {}}',
        chat_line("ok", "Hi again"),
        chat_line("other", "Hi").replace("/v1/chat/completions", "/v1/completions"),
    ]
    client = server.client()
    f = client.files.create(file=write_lines(tmp_path / "bad.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert batch.status in ("validating", "failed")  # validated after create returned (OpenAI's shape)
    batch = wait_batch(client, batch.id)
    assert batch.status == "failed" and batch.failed_at and batch.output_file_id is None
    by_line = {e.line: e.code for e in batch.errors.data}
    assert by_line == {2: "invalid_json", 3: "missing_custom_id", 4: "duplicate_custom_id", 5: "invalid_url"}
    assert all(f"line {e.line}" in e.message for e in batch.errors.data)


def test_bad_create_requests_are_400s_and_unknown_files_404s(server, tmp_path):
    client = server.client()
    f = client.files.create(file=write_lines(tmp_path / "x.jsonl", [chat_line("a", "Hi")]).open("rb"), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.BadRequestError, match="endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="purpose"):
        client.files.create(file=(tmp_path / "x.jsonl").open("rb"), purpose="assistants")


def test_uploads_over_the_limits_are_413s_and_store_nothing(server, tmp_path):
    client = server.client()
    before = [f.id for f in client.files.list()]
    too_many = write_lines(tmp_path / "many.jsonl", [chat_line(f"r{i}", "Hi") for i in range(MAX_LINES + 1)])
    with pytest.raises(openai.APIStatusError, match="SPEC_BATCH_API_MAX_FILE_LINES") as info:
        client.files.create(file=too_many.open("rb"), purpose="batch")
    assert info.value.status_code == 413
    too_big = tmp_path / "big.jsonl"
    too_big.write_text(chat_line("big", "x" * (MAX_BYTES + 10)) + "\n")
    with pytest.raises(openai.APIStatusError, match="SPEC_BATCH_API_MAX_FILE_BYTES") as info:
        client.files.create(file=too_big.open("rb"), purpose="batch")
    assert info.value.status_code == 413
    assert [f.id for f in client.files.list()] == before


def test_a_chunked_upload_is_refused_while_it_arrives(server):
    """No Content-Length: the body is counted as it is read, and refused once past the limit (plus the multipart
    envelope's slack), not spooled whole first."""
    import httpx

    boundary = "spec-batch-test"
    sent = []

    def body():
        yield (
            f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n--{boundary}\r\n'
            f'Content-Disposition: form-data; name="file"; filename="big.jsonl"\r\n\r\n'
        ).encode()
        for _ in range(64):  # 16 MiB in all, far past the limit
            sent.append(1)
            yield (b"x" * 1023 + b"\n") * 256
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {"Content-Type": f"multipart/form-data; boundary={boundary}", "Authorization": "Bearer key-a"}
    try:
        response = httpx.post(f"{server.base_url}/files", content=body(), headers=headers, timeout=60)
    except httpx.TransportError:  # the server answered and closed while the client was still sending
        response = None
    if response is not None:
        assert response.status_code == 413 and "the upload is larger than" in response.text  # counted on arrival
    else:
        assert len(sent) < 64
    assert "big.jsonl" not in [f.filename for f in server.client().files.list()]


def test_cancel_and_list_pages(server, tmp_path):
    client = server.client("key-b")  # its own list: the other tests' batches are key-a's
    lines = [chat_line(f"r{i}", f"Write a long story about the number {i}.", max_tokens=48) for i in range(30)]
    f = client.files.create(file=write_lines(tmp_path / "long.jsonl", lines).open("rb"), purpose="batch")
    ids = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h").id
        for _ in range(3)
    ]
    for batch_id in ids:
        cancelled = client.batches.cancel(batch_id)
        assert cancelled.status in ("cancelling", "cancelled") and cancelled.cancelling_at
    ended = [wait_batch(client, b, timeout=240) for b in ids]
    assert [b.status for b in ended] == ["cancelled"] * 3
    assert all(b.request_counts.completed + b.request_counts.failed == 30 for b in ended)
    page = client.batches.list(limit=1)
    assert len(page.data) == 1 and page.has_more
    assert [b.id for b in client.batches.list(limit=1)] == list(reversed(ids))  # auto-paging, newest first
    assert client.batches.cancel(ids[0]).status == "cancelled"  # again: a no-op
    bad = client.files.create(file=write_lines(tmp_path / "bad.jsonl", ["{"]).open("rb"), purpose="batch")
    failed = client.batches.create(input_file_id=bad.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert wait_batch(client, failed.id).status == "failed"
    with pytest.raises(openai.ConflictError, match="failed"):
        client.batches.cancel(failed.id)


def test_keys_isolate_files_and_batches(server, tmp_path):
    a, b = server.client("key-a"), server.client("key-b")
    f = a.files.create(file=write_lines(tmp_path / "a.jsonl", ["{bad"]).open("rb"), purpose="batch")
    batch = a.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    for call in (
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.files.retrieve(f.id),
        lambda: b.files.content(f.id),
        lambda: b.files.delete(f.id),
        lambda: b.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in [x.id for x in b.files.list()] and batch.id not in [x.id for x in b.batches.list()]
    for key in (None, "wrong"):
        with pytest.raises(openai.AuthenticationError):
            server.client(key).batches.list()
        with pytest.raises(openai.AuthenticationError):
            server.client(key).files.create(file=(tmp_path / "a.jsonl").open("rb"), purpose="batch")
    factory = make_session_factory(server.db_url)
    with factory() as s:  # the owner is stored as a hash of the key, never the key
        owners = {file_sql.get_file(s, f.id, None).owner, file_sql.get_batch(s, batch.id, None)[0].owner}
    assert owners == {owner_hash("key-a")}
    factory.kw["bind"].dispose()
    assert a.files.delete(f.id).deleted and a.batches.retrieve(batch.id).input_file_id == f.id


def test_a_server_killed_mid_batch_loses_nothing(tmp_path):
    env = api_env()
    db = f"sqlite:///{tmp_path / 'restart.db'}"
    lines = [chat_line(f"r{i}", f"List facts about the number {i}.", max_tokens=16) for i in range(10)]
    first = ApiServer(db, tmp_path, env).start()
    client = first.client(None)
    f = client.files.create(file=write_lines(tmp_path / "in.jsonl", lines).open("rb"), purpose="batch")
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 240
    while client.batches.retrieve(batch.id).request_counts.completed < 1 and time.monotonic() < deadline:
        time.sleep(0.3)
    first.kill9()
    second = ApiServer(db, tmp_path, env).start()
    try:
        client = second.client(None)
        done = wait_batch(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 10, second.log()
        outputs = jsonl(client.files.content(done.output_file_id).text)
        assert sorted(o["custom_id"] for o in outputs) == sorted(f"r{i}" for i in range(10))
    finally:
        second.stop()
