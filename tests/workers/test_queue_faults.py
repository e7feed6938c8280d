"""Faults with servers of their own: Redis restarted in the middle of a job (every queued message lost), and
PostgreSQL unreachable for a few seconds while two workers share a job. Real workers, the real default model.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
from db_fixtures import create_pg_database, drop_pg_database
from queue_testlib import WorkerProcess, free_port, wait_for, worker_env, write_completions
from sqlalchemy import select
from sqlalchemy.engine import make_url

from spec_batch.store import chunks as qstore
from spec_batch.store import make_session_factory, migrate_to_head, queries
from spec_batch.store.models import Request
from spec_batch.workers.enqueue import submit_file

pytestmark = [pytest.mark.slow, pytest.mark.redis]

JOB_TIMEOUT_S = 240


class TcpProxy:
    """A TCP forwarder whose `down()` closes every connection and refuses new ones until `up()`: a database
    that is briefly unreachable (network partition, server restart)."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = free_port()
        self._srv: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._running = False

    def up(self) -> TcpProxy:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        srv.bind(("127.0.0.1", self.port))
        srv.listen(64)
        srv.settimeout(0.1)
        self._srv, self._running = srv, True
        threading.Thread(target=self._accept, args=(srv,), daemon=True).start()
        return self

    def _accept(self, srv: socket.socket) -> None:
        while self._running and self._srv is srv:
            try:
                client, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            client.settimeout(None)
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                data = a.recv(65536)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def down(self) -> None:
        self._running = False
        if self._srv is not None:
            self._srv.close()
            self._srv = None
        with self._lock:
            conns, self._conns = self._conns, set()
        for s in conns:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


def _wait_job(factory, job_id: str, workers) -> str:
    def ended():
        with factory() as s:
            status = queries.get_job(s, job_id).status
        return status if status in ("completed", "failed", "cancelled") else None

    try:
        return wait_for(ended, JOB_TIMEOUT_S, 0.25, what=f"job {job_id} to end")
    except AssertionError:
        for w in workers:
            print(f"--- {w.name} ---\n{w.log_tail(80)}")
        raise


def _assert_exactly_once(factory, job_id: str, n: int) -> list[Request]:
    with factory() as s:
        rs = list(s.scalars(select(Request).where(Request.job_id == job_id)))
        job = queries.get_job(s, job_id)
    assert len(rs) == n and len({r.custom_id for r in rs}) == n
    assert all(r.status == "completed" and r.output is not None and r.completed_at for r in rs), [
        (r.custom_id, r.status, r.error) for r in rs
    ]
    assert job.status == "completed" and job.completed_at is not None
    # A chunk whose holder lost the database as the job ended stays running until its lease expires and a reaper
    # finishes it (workers/reaper.py: lease time is the only wait); every other chunk is closed already.
    wait_for(lambda: _chunks_closed(factory, job_id), CHUNKS_SETTLE_S, 0.25, what="the job's chunks to close")
    return rs


CHUNKS_SETTLE_S = 20.0  # a few leases of these tests' workers (3-4 s) and a reaper's period


def _chunks_closed(factory, job_id: str) -> bool:
    with factory() as s:
        return {c.state for c in qstore.job_chunks(s, job_id)} <= {"done", "split"}


def _progress(factory, job_id: str) -> bool:
    with factory() as s:
        c = queries.job_counts(s, job_id)
    return c["completed"] >= 1 and c["completed"] < sum(c.values())


def test_redis_restarted_in_the_middle_of_a_job(tmp_path, redis_server):
    db_url = f"sqlite:///{tmp_path / 'q.db'}"
    migrate_to_head(db_url)
    factory = make_session_factory(db_url)
    env = worker_env(db_url, redis_server.url, lease_seconds=3)
    worker = WorkerProcess("r", env, tmp_path).start()
    try:
        worker.wait_ready()
        path = write_completions(tmp_path / "b.jsonl", 8, max_tokens=8)
        res = submit_file(
            factory,
            path,
            target="default",
            drafter="ngram",
            batch_size=2,
            baseline_sample=0,
            chunk_size=2,
            broker_url=redis_server.url,
        )
        with factory() as s:
            first_epoch = qstore.job_chunks(s, res.job_id)[0].epoch
        wait_for(lambda: _progress(factory, res.job_id), JOB_TIMEOUT_S, 0.1, what="the job to start")
        redis_server.restart(down_s=1.0)  # no persistence: every queued message is gone
        assert _wait_job(factory, res.job_id, [worker]) == "completed"
        _assert_exactly_once(factory, res.job_id, 8)
        with factory() as s:
            epochs = {c.epoch for c in qstore.job_chunks(s, res.job_id)}
        assert epochs - {first_epoch}, "no chunk was re-published after the restart"
        assert worker.alive()
    finally:
        worker.stop()
        print(worker.log_tail(100))


@pytest.mark.postgres
def test_postgres_two_workers_and_a_database_outage(tmp_path, pg_admin, redis_url):
    import redis

    redis.Redis.from_url(redis_url).flushdb()
    db_url = create_pg_database(pg_admin)
    workers = []
    proxy = None
    try:
        migrate_to_head(db_url)
        factory = make_session_factory(db_url)
        proxy = TcpProxy(make_url(db_url).port or 5432).up()
        via_proxy = make_url(db_url).set(port=proxy.port).render_as_string(hide_password=False)
        env = worker_env(via_proxy, redis_url, lease_seconds=4)
        workers = [WorkerProcess(n, env, tmp_path).start() for n in ("pg1", "pg2")]
        for w in workers:
            w.wait_ready()
        path = write_completions(tmp_path / "b.jsonl", 8, max_tokens=8)
        res = submit_file(
            factory,
            path,
            target="default",
            drafter="ngram",
            batch_size=2,
            baseline_sample=0,
            chunk_size=2,
            broker_url=redis_url,
        )
        wait_for(lambda: _progress(factory, res.job_id), JOB_TIMEOUT_S, 0.1, what="the job to start")
        proxy.down()  # the workers lose the database for a few seconds
        time.sleep(2.5)
        proxy.up()
        assert _wait_job(factory, res.job_id, workers) == "completed"
        _assert_exactly_once(factory, res.job_id, 8)
        # both workers took chunks; which of them completes each is Celery's and the outage's business (a worker
        # whose attempts all fell in the outage may leave every request to the other one's retries)
        assert all("process_chunk" in w.log() and "received" in w.log() for w in workers)
        logs = "".join(w.log() for w in workers)
        assert "transient failure" in logs or "lease renewal failed" in logs  # the outage was seen
    finally:
        for w in workers:
            w.stop()
            print(f"--- {w.name} ---\n{w.log_tail(100)}")
        if proxy is not None:
            proxy.down()
        drop_pg_database(db_url)
