"""What the bench apps (worker_app.py, ordering_app.py) share: recording each message's
send-to-handler latency and writing the list to $BENCH_LATENCY_OUT when the worker shuts down.
Latency is now minus the body's `sent_at` when the sender stamped one (its `time.time()`, as Celery's
side of bench/peers stamps it), else minus the producer's `created_at` (taken when the app called
`send()`; whole milliseconds, so half a millisecond too long on average)."""

from __future__ import annotations

import json
import os
import time

import qmq

latencies_ms: list[float] = []


def record(message: qmq.Message) -> None:
    body = message.body
    if isinstance(body, dict) and "sent_at" in body:
        latencies_ms.append((time.time() - body["sent_at"]) * 1000)
        return
    assert message.created_at is not None
    latencies_ms.append((time.time() - message.created_at.timestamp()) * 1000)


def dump_at_shutdown(app: qmq.App) -> None:
    @app.on("worker_shutting_down")
    def dump(worker: object, how: str) -> None:
        if out := os.environ.get("BENCH_LATENCY_OUT"):
            with open(out, "w") as f:
                json.dump(latencies_ms, f)
