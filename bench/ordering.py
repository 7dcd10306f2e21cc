"""Ordered consumption (docs/ordering.md): throughput with 1,000 keys against unordered consumption
in the same run, and outbox-to-handler latency of ordered messages. Real `qmq broker` and
`qmq worker` processes, the load generator in this process, all on this machine (they share its
cores).

    .venv/bin/python bench/ordering.py                 # every case
    .venv/bin/python bench/ordering.py throughput      # 1,000 keys, no-op handler, three workers:
                                                       #   ordered, then unordered, and the ratio
    .venv/bin/python bench/ordering.py latency-unordered  # the same without order keys
    .venv/bin/python bench/ordering.py latency         # ordered messages through the outbox
                                                       #   (PostgreSQL, after-commit sender) at
                                                       #   1,000 msg/s: p50/p99 to the handler

Targets (issue 16): ordered >= 10,000 msg/s. Throughput is a backlog sent beforehand and drained by
the workers, counted from the first finished message to the last (the workers' own
`qmq_worker_messages_succeeded_total`, summed), so neither the sender nor start-up is in it: the
workers start and share the queues, are stopped (SIGSTOP) while the backlog is sent, and go on.
PostgreSQL for the latency case: $BENCH_PG_ADMIN_URL (default
postgresql://postgres@127.0.0.1:5432/postgres).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from workers import (  # noqa: E402
    HOST,
    drop_database,
    free_port,
    latency_figures,
    paced,
    pg_database,
    succeeded,
    throughput,
    wait_port,
)

from qmq.client import Client, OutgoingMessage  # noqa: E402

BODY = {"order": 12345, "note": "x" * 64}  # about 100 bytes as JSON
WORKERS = 3


class Cluster:
    """Broker processes (each a group of its own, given to clients directly) and workers."""

    def __init__(self, brokers: int, flush: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qmq-bench-ordering-"))
        self.procs: list[subprocess.Popen] = []
        self.addresses = []
        for i in range(brokers):
            port = free_port()
            proc = self._start(
                ["broker", "--data-dir", str(self.dir / f"broker-{i}"), "--port", str(port), "--flush", flush],
                {},
            )
            wait_port(port, proc)
            self.addresses.append(f"{HOST}:{port}")

    def _start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "qmq", *args, "-l", "WARNING"],
            cwd=ROOT,
            env={
                **os.environ,
                "PYTHONPATH": f"{ROOT / 'bench'}:{ROOT}",
                "BENCH_BROKERS": ",".join(self.addresses),
                "QMQ_META": "",
                "QMQ_TOKEN": "",
                **env,
            },
        )
        self.procs.append(proc)
        return proc

    def worker(self, subject: str, name: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int]:
        port = free_port()
        proc = self._start(
            ["worker", "-A", "ordering_app:app", "-Q", subject, "-n", name, "--metrics-port", str(port), "-c", "8"],
            env or {},
        )
        wait_port(port, proc)
        return proc, port

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs:
            proc.wait(60)
        shutil.rmtree(self.dir, ignore_errors=True)


def fill(addresses: list[str], subject: str, total: int, keys: int, ordered: bool) -> None:
    with Client(brokers=addresses, batch_size=256) as client:
        for start in range(0, total, 4096):
            batch = [
                OutgoingMessage(subject, BODY, order_key=f"key-{n % keys}" if ordered else None)
                for n in range(start, min(total, start + 4096))
            ]
            results = client.send(batch)
            assert all(r.ok for r in results), [r.error for r in results if not r.ok][:3]


def drain(cluster: Cluster, subject: str, total: int, keys: int, ordered: bool) -> dict:
    workers = [cluster.worker(subject, f"w{i}-{subject}") for i in range(WORKERS)]
    try:
        time.sleep(3.0)  # the workers share the queues (leases) and open their long polls
        for proc, _ in workers:  # stopped while the backlog is sent (well within their leases)
            proc.send_signal(signal.SIGSTOP)
        try:
            fill(cluster.addresses, subject, total, keys, ordered)
        finally:
            for proc, _ in workers:
                proc.send_signal(signal.SIGCONT)
        return throughput(lambda: sum(succeeded(port) for _, port in workers), total, 0.1)
    finally:
        for proc, _ in workers:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in workers:
            proc.wait(60)


def latency(cluster: Cluster, rate: int, seconds: float, keys: int, ordered: bool = True) -> dict:
    import sqlalchemy as sa

    import qmq
    from qmq.db.engine import create_engine

    name, url = pg_database()
    out = cluster.dir / "latency.json"
    subject = "bench.ordered_latency" if ordered else "bench.unordered_latency"
    worker, _ = cluster.worker(subject, "w-latency", {"BENCH_LATENCY_OUT": str(out)})
    try:
        time.sleep(3.0)  # leases taken, first long polls open
        engine = create_engine(url)
        producer = qmq.Producer(brokers=cluster.addresses, engine=engine)
        total = int(rate * seconds)
        for i in paced(rate, total):
            with engine.begin() as conn:
                conn.execute(sa.text("SELECT 1"))
                producer.send(subject, BODY, order_key=f"key-{i % keys}" if ordered else None, connection=conn)
        producer.flush(30)
        time.sleep(2.0)
        producer.close()
        engine.dispose()
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(60)
        drop_database(name)
    return latency_figures(out, total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", default=["throughput", "latency"])
    parser.add_argument("--messages", type=int, default=100_000, help="backlog of each throughput case")
    parser.add_argument("--keys", type=int, default=1000)
    parser.add_argument("--brokers", type=int, default=1)
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--broker-flush", default="sync", choices=["sync", "async"])
    args = parser.parse_args()
    cluster = Cluster(args.brokers, args.broker_flush)
    try:
        for case in args.cases:
            if case == "throughput":
                ordered = drain(cluster, "bench.ordered", args.messages, args.keys, True)
                print(json.dumps({"case": "ordered", "keys": args.keys, "workers": WORKERS, **ordered}), flush=True)
                unordered = drain(cluster, "bench.unordered", args.messages, args.keys, False)
                print(json.dumps({"case": "unordered", "workers": WORKERS, **unordered}), flush=True)
                ratio = ordered["msg_per_s"] / max(unordered["msg_per_s"], 1)
                print(json.dumps({"case": "ordered/unordered", "ratio": round(ratio, 2)}), flush=True)
            elif case in ("latency", "latency-unordered"):
                ordered = case == "latency"
                result = latency(cluster, args.rate, args.seconds, args.keys, ordered)
                case_name = f"{'ordered' if ordered else 'unordered'} outbox-to-handler latency"
                print(json.dumps({"case": case_name, "rate": args.rate, **result}), flush=True)
            else:
                raise SystemExit(f"unknown case {case!r}")
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
