"""A Celery app on Redis with qmq's relay task, for tests/test_contrib_celery.py. Its queue and
key prefix come from the environment so that every test run has its own."""

from __future__ import annotations

import os

from celery import Celery

import qmq.contrib.celery  # noqa: F401  (registers qmq.relay_sweep)

REDIS_URL = os.environ.get("QMQ_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("QMQ_TEST_CELERY_PREFIX", "qmq_test:celery:")
QUEUE = os.environ.get("QMQ_TEST_CELERY_QUEUE", "qmq-test")

app = Celery("qmq_tests", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    task_default_queue=QUEUE,
    broker_transport_options={"global_keyprefix": PREFIX},
    result_backend_transport_options={"global_keyprefix": PREFIX},
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)
