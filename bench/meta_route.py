"""Route look-ups (META_ROUTE) a `qmq meta` server on PostgreSQL answers: the request every client
makes when it starts, when a route is 30 s old, and after each failed send (during a failover every
producer asks again, up to once a second while its send waits: docs/client.md, delivery timeout).

    .venv/bin/python bench/meta_route.py [--groups 3] [--subjects 2000] [--threads 4] [--seconds 10]

Registers `--groups` broker groups (one server each, heartbeats sent by this process), gives
`--subjects` subjects a route, then asks for routes of random subjects from `--threads` connections
as fast as answered. Prints look-ups/s, latency p50/p99 and the meta server's CPU per look-up.
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
from broker import HOST, ROOT, cpu_seconds, free_port, wait_port  # bench/broker.py

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode

PG_ADMIN_URL = os.environ.get("QMQ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
HEARTBEAT_EVERY_S = 1.0  # the fake brokers' heartbeats: well within the meta server's timeout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--subjects", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    name = f"qmq_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    port = free_port()
    meta = subprocess.Popen(
        [sys.executable, "-m", "qmq", "meta", "--port", str(port), "--db", url, "-l", "WARNING"],
        cwd=ROOT,
        env={**os.environ, "QMQ_TOKEN": ""},
    )
    stop = threading.Event()
    try:
        wait_port(port, meta)
        brokers = [(f"g{i}", f"{HOST}:{30000 + i}") for i in range(args.groups)]

        def heartbeats() -> None:
            conn = BlockingConnection.open(HOST, port, client_id="bench-meta", token="")
            while not stop.is_set():
                for group, address in brokers:
                    conn.request(RequestCode.META_HEARTBEAT, {"kind": "broker", "address": address, "group": group})
                stop.wait(HEARTBEAT_EVERY_S)
            conn.close()

        beating = threading.Thread(target=heartbeats, daemon=True)
        beating.start()
        subjects = [f"bench.subject.{i}" for i in range(args.subjects)]
        setup = BlockingConnection.open(HOST, port, client_id="bench-meta", token="")
        for subject in subjects:  # each subject's route made once, as its first producer does
            setup.request(RequestCode.META_ROUTE, {"subject": subject, "create": True})
        setup.close()

        latencies: list[list[float]] = [[] for _ in range(args.threads)]
        deadline = time.monotonic() + args.seconds

        def ask(mine: list[float]) -> None:
            conn = BlockingConnection.open(HOST, port, client_id="bench-meta", token="")
            pick = random.Random(len(mine)).choice
            while time.monotonic() < deadline:
                started = time.perf_counter()
                conn.request(RequestCode.META_ROUTE, {"subject": pick(subjects), "create": True})
                mine.append(time.perf_counter() - started)
            conn.close()

        cpu_before = cpu_seconds(meta.pid)
        began = time.monotonic()
        workers = [threading.Thread(target=ask, args=(mine,)) for mine in latencies]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        took = time.monotonic() - began
        cpu = cpu_seconds(meta.pid) - cpu_before
        every = sorted(x for mine in latencies for x in mine)
        count = len(every)
        print(
            f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, PostgreSQL local; "
            f"{args.groups} groups, {args.subjects} subjects with a route, {args.threads} connections"
        )
        print(
            f"meta route: {count / took:,.0f} look-ups/s, p50 {every[count // 2] * 1000:.2f} ms, "
            f"p99 {every[int(count * 0.99)] * 1000:.2f} ms; meta server CPU {cpu / count * 1e6:.0f} µs a look-up; "
            f"load {os.getloadavg()[0]:.1f}"
        )
    finally:
        stop.set()
        meta.terminate()
        meta.wait(30)
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
