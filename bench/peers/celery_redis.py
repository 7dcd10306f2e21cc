"""Task throughput: Celery on Redis (127.0.0.1:6379) against the qmq worker on a qmq broker.

Both run a no-op task whose argument is bench/workers.py's ~100-byte JSON body, in a real worker
process with the same pool flags (WORKER_FLAGS); Celery keeps its other defaults (acks before the task
runs, no result backend), the qmq worker acks after it. Published/s: `apply_async` one task at a time
(Celery has no batch publish) against `Client.send` in batches (bench/workers.py's `fill`).
Executed/s: a backlog drained by a worker that was running already (Celery: from `add_consumer`
until the queue and the unacked hash are empty; qmq: bench/workers.py's `drain`, first to last
finished message). Latency: one task at a time at TASK_LATENCY_RATE, send to the start of the task.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from pathlib import Path

import redis

from bench.peers.workload import HOST, STAMP, Measurement, Options, paced_blocking

ROOT = Path(__file__).resolve().parents[2]
PORT = 6379
PREFIX = f"qmq-peers:celery:{uuid.uuid4().hex[:8]}:"
os.environ.setdefault("BENCH_CELERY_PREFIX", PREFIX)  # read by celery_app when imported, here and in the worker
IDLE_QUEUE, BENCH_QUEUE, LATENCY_QUEUE = "peers.idle", "peers.bench", "peers.lat"
WORKER_READY_TIMEOUT_S = 60.0
DRAIN_TIMEOUT_S = 600.0
POLL_S = 0.02
# Both workers run with the same pool flags (qmq's as in bench/workers.py). Celery's default prefork pool
# (-c = 2 cores, prefetch multiplier 4) was slower here: about 680 tasks/s and p50 19 ms at 200/s.
WORKER_FLAGS = ("-P", "threads", "-c", "8", "--prefetch-multiplier", "16")
TASK_LATENCY_RATE = 200  # tasks/s: Celery executes about 1,000/s here, so 1,000/s would measure its queue
DURABILITY = (
    'none: Redis with appendonly no, save "" keeps the queue in memory only; Celery acks a task '
    "before running it (its default)"
)
QMQ_DURABILITY = "fsync before every reply (--flush sync); the worker acks after the handler returned (at least once)"


class CeleryWorker:
    """`celery -A bench.peers.celery_app worker`, consuming the idle and latency queues until told more."""

    def __init__(self) -> None:
        from bench.peers.celery_app import app

        self.app = app
        self.name = f"peers-{uuid.uuid4().hex[:6]}@{HOST}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "bench.peers.celery_app",
                "worker",
                "-Q",
                f"{IDLE_QUEUE},{LATENCY_QUEUE}",
                "-n",
                self.name,
                "-l",
                "WARNING",
                *WORKER_FLAGS,
            ],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
        )  # its banner
        deadline = time.monotonic() + WORKER_READY_TIMEOUT_S
        while not app.control.ping(destination=[self.name], timeout=0.5):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the celery worker did not answer a ping")

    def consume(self, queue: str) -> None:
        reply = self.app.control.add_consumer(queue, destination=[self.name], reply=True, timeout=5)
        if not reply:
            raise RuntimeError(f"the celery worker did not confirm consuming {queue}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(60)


def wait_until_empty(client: redis.Redis, queue: str, timeout_s: float) -> None:
    """Until the queue's list and the unacked hash (tasks handed to the worker, not acked) are empty."""
    deadline = time.monotonic() + timeout_s
    while True:
        pipe = client.pipeline(transaction=False)
        pipe.llen(PREFIX + queue)
        pipe.hlen(PREFIX + "unacked")
        if not any(pipe.execute()):
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"celery did not drain {queue} in {timeout_s:.0f} s")
        time.sleep(POLL_S)


def measure_celery(options: Options, body: object) -> Measurement:
    import celery

    from bench.peers.celery_app import noop, stamp

    result = Measurement(
        f"Celery {celery.__version__} on Redis",
        "no: in memory",
        DURABILITY,
        f"real `celery worker {' '.join(WORKER_FLAGS)}`, no result backend; apply_async one at a "
        f"time; latency at {TASK_LATENCY_RATE}/s",
        kind="tasks",
    )
    client = redis.Redis(host=HOST, port=PORT)
    worker = CeleryWorker()
    try:
        started = time.perf_counter()
        for _ in range(options.messages):
            noop.apply_async((body,), queue=BENCH_QUEUE)
        result.produce = options.messages / (time.perf_counter() - started)
        started = time.perf_counter()
        worker.consume(BENCH_QUEUE)
        wait_until_empty(client, BENCH_QUEUE, DRAIN_TIMEOUT_S)
        result.consume = options.messages / (time.perf_counter() - started)

        total = paced_blocking(
            lambda stamped: stamp.apply_async((STAMP.unpack_from(stamped)[0],), queue=LATENCY_QUEUE),
            replace(options, latency_rate=TASK_LATENCY_RATE),
        )
        result.latency(latencies_when_done(client, total, DRAIN_TIMEOUT_S))
    finally:
        worker.stop()
        forget_run(client)
    return result


def latencies_when_done(client: redis.Redis, total: int, timeout_s: float) -> list[float]:
    """The send-to-start latencies (ms) once `total` latency tasks ran; TimeoutError naming how many did."""
    from bench.peers.celery_app import LATENCY_KEY  # imported once the run's environment is set

    deadline = time.monotonic() + timeout_s
    while client.llen(LATENCY_KEY) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {client.llen(LATENCY_KEY)} of {total} latency tasks ran")
        time.sleep(POLL_S)
    return [float(v) for v in client.lrange(LATENCY_KEY, 0, -1)]


def forget_run(client: redis.Redis) -> None:
    """Delete every key this run made on the shared Redis, and let go of the client."""
    keys = list(client.scan_iter(match=PREFIX + "*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def measure_qmq_worker(options: Options) -> Measurement:
    from bench import workers as worker_bench

    result = Measurement(
        "qmq worker",
        "yes: group commit",
        QMQ_DURABILITY,
        f"real `qmq worker {' '.join(WORKER_FLAGS)}` on a `qmq broker --flush sync`; "
        f"Client.send in batches; latency at {TASK_LATENCY_RATE}/s",
        kind="tasks",
    )
    procs = worker_bench.Processes("sync")
    try:
        started = time.perf_counter()
        worker_bench.fill(procs.address, "bench.fill", options.messages)
        result.produce = options.messages / (time.perf_counter() - started)
        result.consume = worker_bench.drain(procs, "bench.noop", options.messages, *WORKER_FLAGS)["msg_per_s"]
        figures = worker_bench.latency(procs, TASK_LATENCY_RATE, options.latency_seconds)
        result.p50_ms, result.p99_ms, result.max_ms = figures["p50_ms"], figures["p99_ms"], figures["max_ms"]
    finally:
        procs.stop()
    return result


def measure(options: Options) -> list[Measurement]:
    from bench.workers import BODY

    return [measure_qmq_worker(options), measure_celery(options, BODY)]
