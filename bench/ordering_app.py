"""The app `bench/ordering.py` runs under `qmq worker -A ordering_app:app` (with bench/ on PYTHONPATH).

- `bench.ordered`: a no-op handler, `ordered=True` (one message of a key at a time, docs/ordering.md);
- `bench.unordered`: the same handler, not ordered, for the ratio;
- `bench.ordered_latency`: ordered, records outbox-to-handler latency (now minus the producer's
  `created_at`, taken when the app called `send()`) and writes the list to $BENCH_LATENCY_OUT when
  the worker shuts down; `bench.unordered_latency`: the same, not ordered, for comparison.
"""

from __future__ import annotations

import os

import latency_recording  # bench/latency_recording.py

import qmq

app = qmq.App("bench", brokers=os.environ.get("BENCH_BROKERS", "127.0.0.1:20881").split(","))


@app.consumer("bench.ordered", group="bench", start="earliest", ordered=True)
def ordered(message: qmq.Message) -> None:
    pass


@app.consumer("bench.unordered", group="bench", start="earliest")
def unordered(message: qmq.Message) -> None:
    pass


@app.consumer("bench.ordered_latency", group="bench", ordered=True)
def ordered_latency(message: qmq.Message) -> None:
    latency_recording.record(message)


@app.consumer("bench.unordered_latency", group="bench")
def unordered_latency(message: qmq.Message) -> None:
    latency_recording.record(message)


latency_recording.dump_at_shutdown(app)
