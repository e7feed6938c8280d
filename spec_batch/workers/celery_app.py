"""The Celery app of spec-batch workers: ``celery -A spec_batch.workers.celery_app worker`` (or the old ``-A workers.celery_app``) or ``spec-batch worker``.

Configuration comes from the environment through :func:`spec_batch.settings.get_settings`, read lazily (when
the app is first used, not at import), so a test or a CLI command can set variables first:

- ``SPEC_BATCH_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``): the broker;
- ``SPEC_BATCH_RESULT_BACKEND`` (default: none; every result is in SQL, so Celery stores none);
- ``SPEC_BATCH_TASK_SOFT_TIME_LIMIT`` / ``SPEC_BATCH_TASK_TIME_LIMIT``: a chunk's soft limit (the task stops
  between decoding batches and its unfinished requests are re-queued) and hard limit (the pool child is
  killed; the lease then re-queues the chunk);
- ``SPEC_BATCH_LEASE_SECONDS``: see spec_batch/workers/reaper.py and spec_batch/jobs/lease.py.

Delivery guarantees (why each setting):

- JSON only, never pickle: ``task_serializer``/``result_serializer``/``accept_content``.
- ``task_acks_late`` + ``task_reject_on_worker_lost``: a message is acknowledged after its task returns, so a
  worker that dies mid-chunk does not lose it; a killed pool child's message is re-queued at once.
- ``worker_prefetch_multiplier=1``: a worker process holds one message at a time, so a slow worker does not
  sit on chunks other workers could run.
- Redis ``visibility_timeout`` longer than the hard time limit: Redis never re-delivers a message whose task
  can still be running. It is only the last resort (a dead worker's message comes back after it); the DB lease
  (the reaper, spec_batch/workers/reaper.py) re-queues a dead worker's chunk after SPEC_BATCH_LEASE_SECONDS.
- ``socket_timeout`` on the broker connection: a publish to a Redis that vanished fails instead of hanging.
"""

from __future__ import annotations

from celery import Celery

from spec_batch.settings import get_settings

from .routing import QUEUE_PREFIX

VISIBILITY_MARGIN_S = 600  # visibility timeout = hard time limit + this
TASK_NAME_PROCESS_CHUNK = "spec_batch.process_chunk"


def celery_config() -> dict:
    """The app's configuration for the current environment (a plain dict: also used by tests)."""
    s = get_settings()
    visibility = s.task_time_limit + VISIBILITY_MARGIN_S
    transport = {
        "visibility_timeout": visibility,
        "socket_timeout": 30,
        "socket_connect_timeout": 5,
        "socket_keepalive": True,
        # how often a dead worker's unacknowledged message is looked for (it is only restored after
        # visibility_timeout anyway; the DB lease is what re-queues a chunk quickly)
        "unacked_restore_interval": 10,
        "unacked_restore_throttle": 6,
    }
    return {
        "broker_url": s.broker_url,
        "result_backend": s.result_backend,
        "task_ignore_result": s.result_backend is None,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "task_acks_on_failure_or_timeout": True,
        "worker_prefetch_multiplier": 1,
        "task_soft_time_limit": s.task_soft_time_limit,
        "task_time_limit": s.task_time_limit,
        "broker_transport_options": transport,
        "result_backend_transport_options": {"visibility_timeout": visibility},
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,  # a worker waits for Redis to come back, forever
        "broker_channel_error_retry": True,
        "task_default_queue": f"{QUEUE_PREFIX}.default.ngram",
        "task_create_missing_queues": True,
        "worker_max_tasks_per_child": None,  # models stay loaded: a pool child is never recycled
        "worker_hijack_root_logger": False,
        "worker_send_task_events": True,  # flower and `celery events` see tasks without -E
        "task_send_sent_event": True,
        "task_track_started": True,
        "enable_utc": True,
        "timezone": "UTC",
    }


app = Celery("spec_batch", include=["spec_batch.workers.tasks"])
# Lazy: the callable runs when the configuration is first read (in the worker, after the CLI set it up).
app.add_defaults(celery_config)

__all__ = ["TASK_NAME_PROCESS_CHUNK", "VISIBILITY_MARGIN_S", "app", "celery_config"]
