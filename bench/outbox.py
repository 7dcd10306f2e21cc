"""The transactional producer and the relay, on PostgreSQL, with a real `qmq broker` (sync flush) and
`qmq relay` as processes on this machine (sharing its cores with PostgreSQL and the load generator).

    .venv/bin/python bench/outbox.py            # every case
    .venv/bin/python bench/outbox.py tx         # business transactions/s, 8 threads, with and without a send
                                                # (alternating rounds; CPU µs per transaction too)
    .venv/bin/python bench/outbox.py tx --ship none   # the same with the outbox row written and nothing
                                                # shipped: the floor under any way of shipping
    .venv/bin/python bench/outbox.py latency    # commit to stored on the broker, after-commit path: p50/p99
    .venv/bin/python bench/outbox.py drain      # the relay draining 1,000,000 pending rows

Targets (issue 18; issue 4's were 25%, 20 ms, 30,000): with the outbox at most 20% fewer
transactions/s; commit to stored p99 < 5 ms; relay drain >= 40,000 msg/s. Bodies are 1 KiB. Each
case makes its own database and drops it. Set QMQ_PG_ADMIN_URL to use another PostgreSQL server.
Record the figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psycopg
import sqlalchemy as sa
from broker import BrokerProcess, cpu_seconds  # bench/broker.py
from sqlalchemy.orm import Session

import qmq
from qmq.client.blocking import Client
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.outbox.rows import insert_on_connection
from qmq.outbox.schema import outbox

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("QMQ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
BODY = {"order": "x" * 1000}  # about 1 KiB as JSON
RELAY_APP_NAME = "qmq-bench-relay"
orders = sa.Table(
    "bench_orders",
    sa.MetaData(),
    sa.Column("id", sa.BigInteger, primary_key=True),
    sa.Column("customer", sa.String(50)),
    sa.Column("amount", sa.Integer),
)


class Database:
    """A throw-away PostgreSQL database with qmq's tables and a business table."""

    def __init__(self) -> None:
        self.name = f"qmq_bench_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.name}"')
        self.url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + self.name
        upgrade(self.url)
        self.engine = create_engine(self.url, pool_size=16)
        orders.create(self.engine)

    def drop(self) -> None:
        self.engine.dispose()
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def transactions(
    threads: int, seconds: float, with_send: bool, ship: str = "after-commit"
) -> tuple[float, dict[str, float]]:
    """Business transactions per second: each inserts one order (and sends one message); and the CPU
    each party spent per transaction (µs: this process, i.e. the application threads and the
    after-commit sender; PostgreSQL's backends of its database; the broker), which the load of a
    shared machine moves less than the rate. `ship` "none": the message's outbox row is written with
    the producer's own values and INSERT, and nothing else happens (no sender, no NOTIFY, no relay):
    what the row alone costs, which no way of shipping it can go below."""
    db = Database()
    broker = BrokerProcess("sync")
    producer = qmq.Producer(brokers=[f"127.0.0.1:{broker.port}"], engine=db.engine)
    counter = iter(range(1, 1 << 62))
    lock = threading.Lock()
    done = [0] * threads
    stop = time.monotonic() + seconds

    @qmq.transactional(producer)
    def place_order(session: Session) -> None:
        with lock:
            order_id = next(counter)
        session.execute(orders.insert().values(id=order_id, customer="c", amount=42))
        if with_send and ship == "none":
            values, _ = producer._prepare("order.created", BODY, str(order_id), (), None, None, None)
            insert_on_connection(session.connection(), values, None, 0.0)
        elif with_send:
            producer.send("order.created", BODY, key=str(order_id))

    def run(i: int) -> None:
        while time.monotonic() < stop:
            place_order()
            done[i] += 1

    started, cpu_started, broker_cpu = time.monotonic(), time.process_time(), cpu_seconds(broker.proc.pid)
    workers = [threading.Thread(target=run, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.monotonic() - started
    producer.flush(60)
    cpu_s = {
        "app": time.process_time() - cpu_started,
        # the pool's backends, opened during the run (the migration's connection is closed)
        "PostgreSQL": sum(map(cpu_seconds, backends(db))),
        "broker": cpu_seconds(broker.proc.pid) - broker_cpu,
    }
    producer.close()
    broker.stop()
    db.drop()
    return sum(done) / elapsed, {party: seconds / max(sum(done), 1) * 1e6 for party, seconds in cpu_s.items()}


def commit_to_stored(rate: float, seconds: float) -> tuple[float, float, int]:
    """Commit (in the app) to stored (by the broker), through the after-commit sender: p50, p99 in ms."""
    db = Database()
    broker = BrokerProcess("sync")
    address = f"127.0.0.1:{broker.port}"
    producer = qmq.Producer(brokers=[address], engine=db.engine)
    committed: dict[str, float] = {}
    stored: dict[str, float] = {}

    def read_stored(total: int) -> None:
        """Each message's time of storing, as the broker stamped it (read after the run: a consumer
        running beside the application would take the GIL from the sender it measures)."""
        deadline = time.monotonic() + 30
        with Client(brokers=[address]) as client:
            sub = client.subscribe("order.created", "bench", start="earliest")
            while len(stored) < total and time.monotonic() < deadline:
                for d in sub.pull(1024, 0.2):
                    stored[d.id] = d.stored_at.timestamp()
                    sub.ack(d)
            sub.close()

    @qmq.transactional(producer)
    def place_order(session: Session, order_id: int) -> str:
        session.execute(orders.insert().values(id=order_id, customer="c", amount=42))
        return producer.send("order.created", BODY)

    total = int(rate * seconds)
    start = time.monotonic()
    for n in range(total):
        time.sleep(max(0.0, start + n / rate - time.monotonic()))
        message_id = place_order(order_id=n)
        committed[message_id] = time.time()
    producer.flush(60)
    read_stored(total)
    producer.close()
    broker.stop()
    db.drop()
    # stored_at has ms resolution: add half a ms so that the figure is not flattered by truncation
    latencies = sorted(max(stored[m] + 0.0005 - t, 0.0) * 1000 for m, t in committed.items() if m in stored)
    return latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)], total - len(latencies)


# Message ids as a producer makes them (qmq/ids.py): UUIDv7, rising with time (here 50 rows a
# millisecond), so a table's ids rise with its rows; or random (v4), as the drain was loaded before.
UUID7_SQL = (
    "SELECT substr(t, 1, 8) || '-' || substr(t, 9, 4) || '-7' || substr(r, 1, 3) || '-8' || substr(r, 4, 3)"
    " || '-' || substr(r, 7, 12) FROM (SELECT lpad(to_hex(%(ms)s::bigint + g / 50), 12, '0') AS t,"
    " md5(random()::text) AS r FROM generate_series(1, %(rows)s) AS g) AS ids"
)
UUID4_SQL = "SELECT gen_random_uuid()::text FROM generate_series(1, %(rows)s)"


def drain(rows: int, batch: int, concurrency: int, ids: str = "v7") -> tuple[float, float, dict[str, float]]:
    """Rows/s of one `qmq relay` draining `rows` pending rows; the seconds it took to load them; and
    the CPU each party spent per row (µs: PostgreSQL's backends serving the relay, the relay, the
    broker), which a shared machine's load moves less than the rate. `ids`: the rows' message ids,
    "v7" as qmq's producer makes them or "v4" (random)."""
    db = Database()
    broker = BrokerProcess("sync")
    body = "{" + '"order":"' + "x" * 1000 + '"}'
    loading = time.monotonic()
    with psycopg.connect(db.url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO qmq_outbox (message_id, subject, body, content_type) "
            f"SELECT id, 'order.created', convert_to(%(body)s, 'UTF8'), 'application/json' "
            f"FROM ({UUID7_SQL if ids == 'v7' else UUID4_SQL}) AS made(id)",
            {"body": body, "rows": rows, "ms": time.time_ns() // 1_000_000},
        )
        conn.execute("VACUUM ANALYZE qmq_outbox")
    loaded = time.monotonic() - loading
    relay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "qmq",
            "relay",
            "--db",
            db.url,
            "--broker",
            f"127.0.0.1:{broker.port}",
            "--batch",
            str(batch),
            "--concurrency",
            str(concurrency),
            "-l",
            "WARNING",
        ],
        cwd=ROOT,
        env={**os.environ, "PGAPPNAME": RELAY_APP_NAME},  # libpq names the relay's connections
    )
    started = time.monotonic()
    broker_cpu = cpu_seconds(broker.proc.pid)
    # Whether any row is still pending: the first entry of the pending index. A count of the pending
    # rows every 0.2 s was a parallel scan of up to a million entries, which took PostgreSQL's CPU (both
    # cores, with its workers) from the drain it measured.
    any_pending = sa.select(outbox.c.id).where(outbox.c.state == "pending").order_by(outbox.c.next_attempt_at).limit(1)
    with db.engine.connect() as conn:
        while True:
            pending = conn.execute(any_pending).first() is not None
            conn.rollback()
            if not pending:
                break
            time.sleep(0.2)
    elapsed = time.monotonic() - started
    cpu_us = {
        "PostgreSQL": sum(map(cpu_seconds, backends(db, RELAY_APP_NAME))),  # backends started with the relay
        "relay": cpu_seconds(relay.pid),
        "broker": cpu_seconds(broker.proc.pid) - broker_cpu,
    }
    relay.terminate()
    relay.wait(60)
    broker.stop()
    db.drop()
    return rows / elapsed, loaded, {party: seconds / rows * 1e6 for party, seconds in cpu_us.items()}


def backends(db: Database, app_name: str | None = None) -> list[int]:
    """The PostgreSQL backends of `db`'s connections (only those named `app_name` by their PGAPPNAME,
    when given), on this machine."""
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        query = "SELECT pid FROM pg_stat_activity WHERE datname = %s AND (%s::text IS NULL OR application_name = %s)"
        pids = [pid for (pid,) in conn.execute(query, (db.name, app_name, app_name))]
    return [pid for pid in pids if Path(f"/proc/{pid}").exists()]  # none: PostgreSQL is on another host


def cpu_text(cpu_us: dict[str, float]) -> str:
    """CPU µs per transaction (or row) of each party, and in all."""
    return (
        "CPU each: "
        + ", ".join(f"{party} {us:.0f}" for party, us in cpu_us.items())
        + f" µs ({sum(cpu_us.values()):.0f} in all)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("case", nargs="?", choices=["tx", "latency", "drain"], default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--threads", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="tx case: rounds of without/with")
    parser.add_argument(
        "--ship",
        choices=["after-commit", "none"],
        default="after-commit",
        help="tx case: how a message is shipped; none: its row is written and nothing more (the floor)",
    )
    parser.add_argument("--rate", type=float, default=500.0, help="transactions/s for the latency case")
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ids", choices=["v7", "v4"], default="v7", help="drain case: the rows' message ids")
    args = parser.parse_args()
    print(
        f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, body 1 KiB, "
        "broker flush sync, PostgreSQL local"
    )
    if args.case in (None, "tx"):
        # Rounds of both, in alternating order, so that a shared machine's load swings hit both alike;
        # the figure is the median of the rounds' ratios.
        losses = []
        for n in range(args.rounds):
            order = (False, True) if n % 2 == 0 else (True, False)
            figures = {with_send: transactions(args.threads, args.seconds, with_send, args.ship) for with_send in order}
            (plain, plain_cpu), (outboxed, outboxed_cpu) = figures[False], figures[True]
            losses.append((1 - outboxed / plain) * 100)
            print(
                f"tx round {n + 1} (ship {args.ship}): {args.threads} threads: "
                f"without send {plain:,.0f} tx/s ({cpu_text(plain_cpu)}), "
                f"with send {outboxed:,.0f} tx/s ({cpu_text(outboxed_cpu)}): {losses[-1]:.1f}% fewer; "
                f"load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        print(
            f"tx (ship {args.ship}): median of {args.rounds} rounds {statistics.median(losses):.1f}% fewer "
            "(target <= 20%)"
        )
    if args.case in (None, "latency"):
        p50, p99, missing = commit_to_stored(args.rate, args.seconds)
        print(
            f"latency: {args.rate:.0f} tx/s: commit to stored p50 {p50:.1f} ms, p99 {p99:.1f} ms "
            f"(target p99 < 5 ms){f', {missing} not stored' if missing else ''}"
        )
    if args.case in (None, "drain"):
        rate, loaded, cpu_us = drain(args.rows, args.batch, args.concurrency, args.ids)
        print(
            f"drain: {args.rows:,} rows ({args.ids} ids), batch {args.batch}, {args.concurrency} threads: "
            f"{rate:,.0f} msg/s "
            f"(target >= 40,000; rows loaded in {loaded:.0f} s); CPU per row: "
            + ", ".join(f"{party} {us:.1f} µs" for party, us in cpu_us.items())
            + f" ({sum(cpu_us.values()):.1f} in all); load {os.getloadavg()[0]:.1f}"
        )


if __name__ == "__main__":
    main()
