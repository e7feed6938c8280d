"""Kept for `celery -A workers.celery_app`: the queue lives in spec_batch.workers."""
