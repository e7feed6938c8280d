"""The queue: the Celery app and its chunk task, publishing, routing, submit/enqueue, the reaper, and the
workers' Prometheus metrics. A task only calls the jobs layer (runner, baseline, lifecycle); the broker is
Redis. `celery -A spec_batch.workers.celery_app worker` (or `spec-batch worker`) starts a worker; the old
`celery -A workers.celery_app worker` keeps working through the thin `workers/` package at the repository root."""
