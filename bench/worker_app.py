"""The app `bench/workers.py` runs under `qmq worker -A worker_app:app` (with bench/ on PYTHONPATH).

- `bench.noop`: a handler that does nothing;
- `bench.idem`: nothing either, but `idempotent=True` on PostgreSQL: one transaction per message with
  its `qmq_consumed` insert;
- `bench.latency`: records send-to-handler latency (bench/latency_recording.py) and writes the list
  to $BENCH_LATENCY_OUT when the worker shuts down.
"""

from __future__ import annotations

import os

import latency_recording  # bench/latency_recording.py

import qmq

app = qmq.App("bench", brokers=[os.environ.get("BENCH_BROKER", "127.0.0.1:20881")], db=os.environ.get("BENCH_DB"))


@app.consumer("bench.noop", group="bench", start="earliest")
def noop(message: qmq.Message) -> None:
    pass


if app.db_url:

    @app.consumer("bench.idem", group="bench", start="earliest", idempotent=True)
    def idem(message: qmq.Message) -> None:
        pass


@app.consumer("bench.latency", group="bench")
def latency(message: qmq.Message) -> None:
    latency_recording.record(message)


latency_recording.dump_at_shutdown(app)
