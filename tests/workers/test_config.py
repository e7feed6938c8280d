"""The workers' configuration: Celery settings (JSON only, late acks, limits), leases, settings read through
spec_batch.settings, transient failures and their backoff, and the worker module's import."""

from __future__ import annotations

import os
import subprocess
import sys

from queue_testlib import REPO

from spec_batch.settings import get_settings
from spec_batch.workers import retries, tasks
from spec_batch.workers import runtime as worker_runtime
from spec_batch.workers.celery_app import celery_config


def test_celery_settings(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_BROKER_URL", raising=False)
    monkeypatch.setenv("SPEC_BATCH_TASK_SOFT_TIME_LIMIT", "100")
    conf = celery_config()
    assert conf["broker_url"] == "redis://127.0.0.1:6379/0"
    # JSON only, never pickle
    assert conf["task_serializer"] == conf["result_serializer"] == conf["event_serializer"] == "json"
    assert conf["accept_content"] == conf["result_accept_content"] == ["json"]
    assert "pickle" not in repr(conf)
    # a killed worker does not lose its message; one message per worker process at a time
    assert conf["task_acks_late"] and conf["task_reject_on_worker_lost"]
    assert conf["worker_prefetch_multiplier"] == 1
    # soft < hard < Redis visibility timeout
    assert conf["task_soft_time_limit"] == 100
    assert (
        conf["task_soft_time_limit"] < conf["task_time_limit"] < conf["broker_transport_options"]["visibility_timeout"]
    )
    assert conf["worker_max_tasks_per_child"] is None  # models stay loaded


def test_lease_default_is_minutes(monkeypatch):
    monkeypatch.delenv("SPEC_BATCH_LEASE_SECONDS", raising=False)
    assert 60 <= get_settings().lease_seconds < 3600
    monkeypatch.setenv("SPEC_BATCH_LEASE_SECONDS", "2")
    assert get_settings().lease_seconds == 2


def test_app_is_json_only_after_import():
    from spec_batch.workers.celery_app import app

    assert app.conf.accept_content == ["json"] and app.conf.task_serializer == "json"
    assert tasks.process_chunk.name == "spec_batch.process_chunk"
    assert tasks.process_chunk.acks_late and tasks.process_chunk.reject_on_worker_lost


def test_transient_errors_are_told_apart():
    import kombu.exceptions
    import sqlalchemy.exc as sa_exc

    lost = sa_exc.OperationalError("SELECT 1", {}, Exception("server closed the connection unexpectedly"))
    assert retries.is_transient(lost)
    assert retries.is_transient(kombu.exceptions.OperationalError("Error 111 connecting"))
    assert retries.is_transient(ConnectionRefusedError())
    assert not retries.is_transient(sa_exc.OperationalError("x", {}, Exception("no such table: jobs")))
    assert not retries.is_transient(ValueError("bad input"))
    from spec_batch.errors import UnknownModelError

    assert not retries.is_transient(UnknownModelError("no model"))


def test_worker_module_does_not_touch_the_database_at_import():
    """Importing the app (as the main worker process does before forking) opens no connection."""
    code = (
        "import os; os.environ['SPEC_BATCH_DATABASE_URL']='postgresql://nobody@127.0.0.1:1/none';"
        "import workers.celery_app, spec_batch.workers.tasks; from spec_batch.workers.runtime import runtime_of_this_process; assert runtime_of_this_process() is None"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=str(REPO), capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    assert proc.returncode == 0, proc.stderr


def test_retry_backoff_doubles_with_jitter_and_is_capped(monkeypatch):
    monkeypatch.setattr(retries.random, "random", lambda: 1.0)  # the top of the jitter range
    assert [retries.retry_delay(n) for n in (0, 1, 3)] == [1, 2, 8]
    assert retries.retry_delay(30) == retries.RETRY_BACKOFF_MAX_S
    monkeypatch.setattr(retries.random, "random", lambda: 0.0)  # the bottom: half of it
    assert retries.retry_delay(3) == 4


def test_workers_take_device_and_threads_from_settings(monkeypatch, tmp_path):
    import torch

    monkeypatch.setenv("SPEC_BATCH_DEVICE", "cuda:3")
    monkeypatch.setenv("SPEC_BATCH_TORCH_THREADS", "2")
    monkeypatch.setenv("SPEC_BATCH_DATABASE_URL", f"sqlite:///{tmp_path / 'w.db'}")
    assert (get_settings().device, get_settings().torch_threads) == ("cuda:3", 2)
    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch, "set_num_interop_threads", lambda n: None)
    worker_runtime.apply_torch_threads()
    assert threads == [2]

    class NoHeartbeat:
        def __init__(self, *a, **kw):
            pass

        def start(self):
            return self

    loads = []
    monkeypatch.setattr(worker_runtime.lease, "Heartbeat", NoHeartbeat)
    monkeypatch.setattr(
        worker_runtime, "shared_decoder", lambda target, draft, **kw: loads.append((target, draft, kw)) or "dec"
    )
    rt = worker_runtime.Runtime()
    assert rt.decoder("default", "ngram") == "dec" and rt.decoder("default", "ngram") == "dec"
    assert [(t, d, kw["device"]) for t, d, kw in loads] == [("default", "ngram", "cuda:3")] * 2  # one cache: loading's
    rt.session_factory.kw["bind"].dispose()
