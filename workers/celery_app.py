"""The old path of the Celery app: `celery -A workers.celery_app worker` keeps working. The app lives in
spec_batch.workers.celery_app (the whole system is one package)."""

from spec_batch.workers.celery_app import TASK_NAME_PROCESS_CHUNK, app, celery_config

__all__ = ["TASK_NAME_PROCESS_CHUNK", "app", "celery_config"]
