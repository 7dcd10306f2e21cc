"""Worker throughput and latency: a real `qmq broker` process, a real `qmq worker` process, and the
load generator in this process, all on this machine (they share its cores).

    .venv/bin/python bench/workers.py                # every case
    .venv/bin/python bench/workers.py noop           # no-op handler, -P threads -c 8: drain a backlog
    .venv/bin/python bench/workers.py idempotent     # the same with SQL idempotency on PostgreSQL
    .venv/bin/python bench/workers.py latency        # send to handler at 1,000 msg/s: p50/p99

Targets (issue 5): no-op >= 20,000 msg/s; with SQL idempotency on PostgreSQL >= 3,000 msg/s;
send-to-handler p99 < 10 ms at 1,000 msg/s. Throughput is a backlog sent beforehand and drained by
the worker, counted from its first finished message to its last (the worker's own
`qmq_worker_messages_succeeded_total`), so neither the sender nor the worker's start-up is in it.
PostgreSQL: $BENCH_PG_ADMIN_URL (default postgresql://postgres@127.0.0.1:5432/postgres); a database
is made for the run and dropped after.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.broker import HOST, broker_command, free_port, wait_port  # noqa: E402
from qmq.client import Client, OutgoingMessage  # noqa: E402

PG_ADMIN_URL = os.environ.get("BENCH_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BODY = {"order": 12345, "note": "x" * 64}  # about 100 bytes as JSON
DRAIN_DEADLINE_S = 600.0  # a backlog not handled within this fails the case


class Processes:
    """The broker and the worker, as `qmq` processes in a temporary directory."""

    def __init__(self, flush: str, serve_ahead_s: float | None = None) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qmq-bench-worker-"))
        self.broker_port = free_port()
        self.broker_metrics_port = free_port()
        options = ["--metrics-port", str(self.broker_metrics_port)]
        if serve_ahead_s is not None:
            options += ["--serve-ahead", str(serve_ahead_s)]
        self.broker = subprocess.Popen(
            broker_command(self.dir / "broker", self.broker_port, flush) + options,
            cwd=ROOT,
            env={**os.environ, "QMQ_META": "", "QMQ_TOKEN": ""},
        )
        wait_port(self.broker_port, self.broker)
        self.address = f"{HOST}:{self.broker_port}"

    def worker(self, subject: str, *flags: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
        port = free_port()
        settings = {
            **os.environ,
            "PYTHONPATH": f"{ROOT / 'bench'}:{ROOT}",
            "BENCH_BROKER": self.address,
            "QMQ_META": "",
            "QMQ_TOKEN": "",
            **(env or {}),
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qmq",
                "worker",
                "-A",
                "worker_app:app",
                "-Q",
                subject,
                "--metrics-port",
                str(port),
                "-l",
                "WARNING",
                *flags,
            ],
            cwd=ROOT,
            env=settings,
        )
        wait_port(port, proc)
        return proc, port

    def stop(self) -> None:
        self.broker.terminate()
        self.broker.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def succeeded(port: int) -> float:
    return metric_sum(port, "qmq_worker_messages_succeeded_total")


def metric_sum(port: int, name: str) -> float:
    """The sum of a counter's samples on a process's /metrics."""
    with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " ")))


def fill(address: str, subject: str, total: int) -> None:
    with Client(brokers=[address], batch_size=256) as client:
        for start in range(0, total, 4096):
            batch = [OutgoingMessage(subject, BODY) for _ in range(min(4096, total - start))]
            results = client.send(batch)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]


def throughput(handled: Callable[[], float], total: int, poll_s: float) -> dict:
    """Wait (DRAIN_DEADLINE_S at most) until `handled()` reaches `total`; the rate from the first message handled
    on, so that the workers' start-up does not count."""
    first_at = first_count = None
    deadline = time.monotonic() + DRAIN_DEADLINE_S
    while time.monotonic() < deadline:
        count, now = handled(), time.monotonic()
        if first_at is None and count > 0:
            first_at, first_count = now, count
        if count >= total:
            break
        time.sleep(poll_s)
    else:
        raise RuntimeError(f"only {count} of {total} handled")
    assert first_at is not None and first_count is not None
    seconds = max(now - first_at, 1e-3)
    return {"messages": total, "seconds": round(seconds, 2), "msg_per_s": round((count - first_count) / seconds)}


def drain(procs: Processes, subject: str, total: int, *flags: str, env: dict[str, str] | None = None) -> dict:
    fill(procs.address, subject, total)
    worker, port = procs.worker(subject, *flags, env=env)
    try:
        return throughput(lambda: succeeded(port), total, 0.2)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)


def latency(procs: Processes, rate: int, seconds: float) -> dict:
    out = procs.dir / "latency.json"
    worker, _ = procs.worker("bench.latency", "-P", "threads", "-c", "8", env={"BENCH_LATENCY_OUT": str(out)})
    time.sleep(1.0)  # let the worker's first long poll start
    total = int(rate * seconds)
    with Client(brokers=[procs.address]) as client:
        for _ in paced(rate, total):
            client.send_one("bench.latency", {**BODY, "sent_at": time.time()})
    time.sleep(1.0)
    worker.send_signal(signal.SIGTERM)
    worker.wait(60)
    # how many reached the worker through serving ahead (qmq/broker/ahead.py)
    served_ahead = int(metric_sum(procs.broker_metrics_port, "qmq_broker_served_ahead_total"))
    return {**latency_figures(out, total), "served_ahead": served_ahead}


def latency_figures(out: Path, sent: int) -> dict:
    """The figures of the latencies (ms) a worker wrote to `out` (bench/latency_recording.py)."""
    values = sorted(json.loads(out.read_text()))
    return {
        "messages": len(values),
        "sent": sent,
        "p50_ms": round(statistics.median(values), 2),
        "p99_ms": round(values[int(len(values) * 0.99) - 1], 2),
        "max_ms": round(values[-1], 2),
    }


def paced(rate: float, total: int) -> Iterator[int]:
    """0 .. total-1, the i-th at `i / rate` seconds after the first: an open-loop load."""
    start = time.monotonic()
    for i in range(total):
        pause = start + i / rate - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        yield i


def pg_database() -> tuple[str, str]:
    import psycopg

    name = f"qmq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    from qmq.db.migrate import upgrade

    upgrade(url)
    return name, url


def drop_database(name: str) -> None:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=["noop", "idempotent", "latency"])
    parser.add_argument("--messages", type=int, default=200_000, help="backlog of the no-op case")
    parser.add_argument("--idempotent-messages", type=int, default=30_000)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--concurrency", default="8")
    parser.add_argument("--pool", default="threads", choices=["threads", "processes", "solo"])
    parser.add_argument("--broker-flush", default="sync", choices=["sync", "async"])
    parser.add_argument("--prefetch-multiplier", default="16")
    parser.add_argument(
        "--broker-serve-ahead", type=float, default=None, help="the broker's --serve-ahead (0 turns it off)"
    )
    args = parser.parse_args()
    pool = ["-P", args.pool, "-c", args.concurrency, "--prefetch-multiplier", args.prefetch_multiplier]
    procs = Processes(args.broker_flush, args.broker_serve_ahead)
    try:
        for case in args.cases:
            if case == "noop":
                result = drain(procs, "bench.noop", args.messages, *pool)
            elif case == "idempotent":
                name, url = pg_database()
                try:
                    result = drain(procs, "bench.idem", args.idempotent_messages, *pool, env={"BENCH_DB": url})
                finally:
                    drop_database(name)
            elif case == "latency":
                result = latency(procs, args.rate, args.seconds)
            else:
                raise SystemExit(f"unknown case {case!r}")
            print(
                json.dumps({"case": case, "pool": " ".join(pool), "broker_flush": args.broker_flush, **result}),
                flush=True,
            )
    finally:
        procs.stop()


if __name__ == "__main__":
    main()
