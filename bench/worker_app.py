"""The app `bench/workers.py` runs under `qmq worker -A worker_app:app` (with bench/ on PYTHONPATH).

- `bench.noop`: a handler that does nothing;
- `bench.idem`: nothing either, but `idempotent=True` on PostgreSQL: one transaction per message with
  its `qmq_consumed` insert;
- `bench.latency`: records send-to-handler latency (now minus the body's `sent_at`, the sender's
  `time.time()` as Celery's side of bench/peers stamps it; the envelope's `created_at` is whole
  milliseconds, which would add half a millisecond on average) and writes the list to
  $BENCH_LATENCY_OUT when the worker shuts down.
"""

from __future__ import annotations

import json
import os
import time

import qmq

app = qmq.App("bench", brokers=[os.environ.get("BENCH_BROKER", "127.0.0.1:20881")], db=os.environ.get("BENCH_DB"))
latencies_ms: list[float] = []


@app.consumer("bench.noop", group="bench", start="earliest")
def noop(message: qmq.Message) -> None:
    pass


if app.db_url:

    @app.consumer("bench.idem", group="bench", start="earliest", idempotent=True)
    def idem(message: qmq.Message) -> None:
        pass


@app.consumer("bench.latency", group="bench")
def latency(message: qmq.Message) -> None:
    latencies_ms.append((time.time() - message.body["sent_at"]) * 1000)


@app.on("worker_shutting_down")
def dump(worker: object, how: str) -> None:
    if out := os.environ.get("BENCH_LATENCY_OUT"):
        with open(out, "w") as f:
            json.dump(latencies_ms, f)
