"""The outbox path, commit to handler: a business transaction on PostgreSQL commits, and a worker's
handler starts on what it sent. qmq: `producer.send` in the transaction (an outbox row), the
after-commit sender ships it to a `qmq broker --flush sync`, a real `qmq worker` runs the handler.
Celery: the same transaction, and `task.apply_async` in the session's after-commit hook, as
`transaction.on_commit(lambda: task.delay(...))` does in Django, on Redis, to a real `celery worker`.

Both: one transaction at a time at TASK_LATENCY_RATE for `latency_seconds`, each inserting one order
row; the commit is stamped (wall clock) in the session's `after_commit` hook, the handler's start in
the worker; workers run with celery_redis.py's WORKER_FLAGS. Celery's message is not durable (Redis
in memory, acked before the task runs) and is lost if the app dies between its commit and the
`delay`; qmq's is in the transaction and stored with an fsync before the worker sees it.

This module is also the `qmq worker -A bench.peers.outbox_path:app` the qmq case runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import qmq

SUBJECT = "peers.outbox"
OUT_ENV = "BENCH_OUTBOX_OUT"  # where the worker writes {message id: handler start} at shutdown
BODY = {"order": 12345, "note": "x" * 64}  # about 100 bytes as JSON, as bench/workers.py's
QMQ_LABEL = "qmq outbox -> qmq worker"
HANDLED_TIMEOUT_S = 60.0

# ---- the worker's side (imported by `qmq worker`) -------------------------------------------------------

app = qmq.App("peers-outbox", brokers=[os.environ.get("BENCH_BROKER", "127.0.0.1:20881")])
started_at: dict[str, float] = {}


@app.consumer(SUBJECT, group="peers", start="earliest")
def handle(message: qmq.Message) -> None:
    started_at[message.id] = time.time()


@app.on("worker_shutting_down")
def dump(worker: object, how: str) -> None:
    if out := os.environ.get(OUT_ENV):
        Path(out).write_text(json.dumps(started_at))


# ---- the runner's side -----------------------------------------------------------------------------------


class Orders:
    """A throw-away PostgreSQL database with qmq's tables and a business table."""

    def __init__(self) -> None:
        import sqlalchemy as sa

        from bench.workers import pg_database
        from qmq.db.engine import create_engine

        self.name, url = pg_database()  # migrated: the outbox is there
        self.engine = create_engine(url)
        self.table = sa.Table(
            "peers_orders", sa.MetaData(), sa.Column("id", sa.BigInteger, primary_key=True), sa.Column("n", sa.Integer)
        )
        self.table.create(self.engine)

    def drop(self) -> None:
        from bench.workers import drop_database

        self.engine.dispose()
        drop_database(self.name)


def paced_transactions(orders: Orders, rate: int, seconds: float, in_transaction, on_commit) -> int:
    """`rate` transactions/s for `seconds`: each inserts an order and calls `in_transaction(session)`;
    `on_commit(session, value)` runs in the session's after-commit hook with what it returned."""
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    total = int(rate * seconds)
    started = time.perf_counter()
    for n in range(total):
        pause = started + n / rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        with Session(orders.engine) as session:
            returned = []
            sa.event.listen(session, "after_commit", lambda s, r=returned: on_commit(s, r[0]))
            with session.begin():
                session.execute(orders.table.insert().values(id=n, n=n))
                returned.append(in_transaction(session))
    return total


def measure_qmq(options, orders: Orders):
    from bench import workers as worker_bench
    from bench.peers.celery_redis import QMQ_DURABILITY, TASK_LATENCY_RATE, WORKER_FLAGS
    from bench.peers.workload import Measurement

    result = Measurement(
        QMQ_LABEL,
        "yes: group commit",
        f"the message is an outbox row of the transaction; {QMQ_DURABILITY}",
        f"Producer.send in a SQLAlchemy transaction on PostgreSQL, after-commit sender, `qmq broker --flush sync`, "
        f"real `qmq worker {' '.join(WORKER_FLAGS)}`; one transaction at a time at {TASK_LATENCY_RATE}/s",
        kind="outbox",
    )
    procs = worker_bench.Processes("sync")
    out = procs.dir / "outbox-path.json"
    metrics_port = worker_bench.free_port()
    worker = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qmq",
            "worker",
            "-A",
            "bench.peers.outbox_path:app",
            "-Q",
            SUBJECT,
            "--metrics-port",
            str(metrics_port),
            "-l",
            "WARNING",
            *WORKER_FLAGS,
        ],
        cwd=worker_bench.ROOT,
        env={
            **os.environ,
            "PYTHONPATH": str(worker_bench.ROOT),
            "BENCH_BROKER": procs.address,
            OUT_ENV: str(out),
            "QMQ_META": "",
            "QMQ_TOKEN": "",
        },
    )
    producer = qmq.Producer(brokers=[procs.address], engine=orders.engine)
    committed: dict[str, float] = {}
    try:
        worker_bench.wait_port(metrics_port, worker)
        time.sleep(1.0)  # the worker's first long poll is waiting, as bench/workers.py's latency case
        total = paced_transactions(
            orders,
            TASK_LATENCY_RATE,
            options.latency_seconds,
            lambda session: producer.send(SUBJECT, BODY, session=session),
            lambda session, message_id: committed.__setitem__(message_id, time.time()),
        )
        deadline = time.monotonic() + HANDLED_TIMEOUT_S
        while worker_bench.succeeded(metrics_port) < total:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {worker_bench.succeeded(metrics_port):.0f} of {total} handled")
            time.sleep(0.05)
    finally:
        producer.close()
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
    handled = json.loads(out.read_text()) if out.exists() else {}
    procs.stop()
    result.latency([(handled[m] - t) * 1000 for m, t in committed.items() if m in handled])
    return result


def measure_celery(options, orders: Orders):
    import celery
    import redis

    from bench.peers.celery_app import LATENCY_KEY, stamp
    from bench.peers.celery_redis import (
        DURABILITY,
        LATENCY_QUEUE,
        PORT,
        TASK_LATENCY_RATE,
        CeleryWorker,
        forget_run,
        latencies_when_done,
    )
    from bench.peers.workload import HOST, Measurement

    result = Measurement(
        f"Celery {celery.__version__} on_commit(delay) on Redis",
        "no: in memory",
        f"{DURABILITY}; a crash between the commit and the delay() loses the task",
        f"apply_async in the SQLAlchemy session's after_commit hook (Django's transaction.on_commit), real "
        f"`celery worker`; one transaction at a time at {TASK_LATENCY_RATE}/s",
        kind="outbox",
    )
    client = redis.Redis(host=HOST, port=PORT)
    client.delete(LATENCY_KEY)
    worker = CeleryWorker()
    try:
        total = paced_transactions(
            orders,
            TASK_LATENCY_RATE,
            options.latency_seconds,
            lambda session: None,
            lambda session, _: stamp.apply_async((time.time(),), queue=LATENCY_QUEUE),
        )
        result.latency(latencies_when_done(client, total, HANDLED_TIMEOUT_S))
    finally:
        worker.stop()
        forget_run(client)
    return result


def measure(options) -> list:
    """The qmq outbox path, then Celery's on_commit(delay), each on a fresh orders database."""
    results = []
    for case in (measure_qmq, measure_celery):
        orders = Orders()
        try:
            results.append(case(options, orders))
        finally:
            orders.drop()
    return results


if __name__ == "__main__":  # one run of both, on its own: python -m bench.peers.outbox_path
    from bench.peers.workload import Options

    for m in measure(Options(latency_seconds=float(sys.argv[1]) if len(sys.argv) > 1 else Options.latency_seconds)):
        print(f"{m.system}: p50 {m.p50_ms:.2f} ms, p99 {m.p99_ms:.2f} ms, max {m.max_ms:.2f} ms")
