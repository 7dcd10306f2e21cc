"""The Celery app bench/peers/celery_redis.py runs under a real `celery worker` process.

Celery's defaults, with Redis as broker and no result backend: `peers.noop` does nothing with its
argument; `peers.stamp` pushes its send-to-start latency (ms) to a Redis list for the runner to read.
Every key the run makes starts with $BENCH_CELERY_PREFIX (kombu's `global_keyprefix`), so the run
neither sees nor touches anyone else's keys on the shared Redis.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

BROKER_URL = os.environ.get("BENCH_CELERY_BROKER", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("BENCH_CELERY_PREFIX", "qmq-peers:celery:")
LATENCY_KEY = PREFIX + "latency-ms"

app = Celery("qmq_peers", broker=BROKER_URL)
app.conf.update(
    broker_transport_options={"global_keyprefix": PREFIX},
    task_ignore_result=True,
    broker_connection_retry_on_startup=True,
)
_latency_client: redis.Redis | None = None


@app.task(name="peers.noop")
def noop(body: object) -> None:
    pass


@app.task(name="peers.stamp")
def stamp(sent_at: float) -> None:
    global _latency_client
    delay_ms = (time.time() - sent_at) * 1000
    if _latency_client is None:
        _latency_client = redis.Redis.from_url(BROKER_URL)
    _latency_client.rpush(LATENCY_KEY, delay_ms)
