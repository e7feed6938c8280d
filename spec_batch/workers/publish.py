"""Publishing a chunk's message: one Celery task per chunk, task id = chunk id, on the chunk's queue.

Used by submit and resume (workers/enqueue.py) and by the reaper (workers/reaper.py, through the task module's
runtime). The message names the task by its registered name, so publishing needs the app, not the task module.
"""

from __future__ import annotations

from typing import Any

from .celery_app import TASK_NAME_PROCESS_CHUNK, app

# A publish to a Redis that vanished fails after a few quick tries instead of hanging.
PUBLISH_RETRY_POLICY = {"max_retries": 2, "interval_start": 0.2, "interval_step": 0.5, "interval_max": 1.0}


def _declare(channel: Any, queue: str) -> None:
    """Declares the queue and its binding on every publish, never from a cache: after a Redis restart without
    persistence the bindings are gone, and a message published to an unbound exchange would be dropped."""
    from kombu import Exchange, Queue

    Queue(queue, Exchange(queue, type="direct"), routing_key=queue)(channel).declare()


def publish_chunk(chunk_id: str, queue: str, *, broker_url: str | None = None) -> None:
    """Publishes the message of a chunk (task id = chunk id) to its queue, on the app's broker or on
    `broker_url`. Raises (kombu.exceptions.OperationalError) when the broker cannot be reached."""
    options: dict[str, Any] = dict(
        args=[chunk_id],
        task_id=chunk_id,
        queue=queue,
        routing_key=queue,
        retry=True,
        retry_policy=PUBLISH_RETRY_POLICY,
    )
    if broker_url and broker_url != app.conf.broker_url:
        with app.connection_for_write(broker_url) as conn:
            conn.ensure_connection(max_retries=2)
            producer = app.amqp.Producer(conn, auto_declare=False)
            _declare(producer.channel, queue)
            app.send_task(TASK_NAME_PROCESS_CHUNK, producer=producer, **options)
        return
    with app.producer_or_acquire() as producer:
        with producer.connection._reraise_as_library_errors():
            _declare(producer.channel, queue)
        app.send_task(TASK_NAME_PROCESS_CHUNK, producer=producer, **options)


__all__ = ["publish_chunk"]
