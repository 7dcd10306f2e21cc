"""The nightly reconciliation at scale: 10,000,000 outbox rows in PostgreSQL and the matching broker
ledger, with a sprinkling of planted anomalies; `qmq reconcile` timed from its start (a cold JVM:
what a nightly run pays) with `--master local[2] --driver-memory 4g`.

    .venv/bin/python bench/reconcile.py                  # 10,000,000 rows
    .venv/bin/python bench/reconcile.py --rows 200000    # a quick look
    .venv/bin/python bench/reconcile.py --export 1000000 # `qmq ledger export` of a store of 1,000,000 messages

Target (issue 7): under 5 minutes, every planted anomaly found. The outbox rows are generated inside
PostgreSQL (`INSERT ... SELECT generate_series`, in 1,000,000-row transactions, into the real
`qmq_outbox` with its indexes) and the ledger by Spark in another process (its layout is the one
`qmq ledger export` writes: by day and broker). Message ids are UUIDv7, computed from the row number
by the same formula on both sides. Planted: rows never stored (`not_shipped`, half of them pending,
half marked sent), a group that never acknowledged (`not_acked`), dead letters, deliveries made
twice (`redelivered`), messages with no outbox row (`orphaned`) and ten whose producer header names
the outbox (`rolled_back`). The run passes if the anomalies found are exactly those planted.
Record the figures in docs/benchmarks.md. Set QMQ_PG_ADMIN_URL to use another PostgreSQL server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
PG_ADMIN_URL = os.environ.get("QMQ_PG_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
INSERT_CHUNK_ROWS = 1_000_000
SUBJECTS = 10  # subject-0 .. subject-9; group g-a consumes all, g-b subject-0 and subject-1 too
SPAN_MS = 20 * 3600 * 1000  # the messages are made over 20 hours of yesterday, from 01:00
EVERY = 100_000  # one planted anomaly of each kind per this many rows
PLANTED = {"not_shipped": 7, "not_acked": 11, "dead_lettered": 13, "redelivered": 17}  # row % EVERY == value
EXTRA = {"orphaned": 100, "rolled_back": 10}  # ledger-only messages, numbered after the outbox rows

# UUIDv7 of row i: its time, then i in the counter and random fields (unique, and the same in SQL and Spark).
SQL_ID = (
    "substr(h,1,8)||'-'||substr(h,9,4)||'-7'||lpad(to_hex(i % 4096),3,'0')||'-8'||"
    "lpad(to_hex((i / 4096) % 4096),3,'0')||'-'||lpad(to_hex(i),12,'0')"
)
SPARK_ID = (
    "concat(substr(h,1,8),'-',substr(h,9,4),'-7',lower(lpad(hex(id % 4096),3,'0')),'-8',"
    "lower(lpad(hex((id div 4096) % 4096),3,'0')),'-',lower(lpad(hex(id),12,'0')))"
)


def message_id(i: int, base_ms: int, rows: int) -> str:
    h = f"{base_ms + i * SPAN_MS // rows:012x}"
    return f"{h[:8]}-{h[8:12]}-7{i % 4096:03x}-8{(i // 4096) % 4096:03x}-{i:012x}"


def create_outbox(url: str, rows: int, base_ms: int) -> float:
    """`rows` outbox rows, made in PostgreSQL; the seconds it took."""
    started = time.monotonic()
    # In a child: a module of bench/ named like a qmq package would shadow it here.
    subprocess.run(
        [sys.executable, "-m", "qmq", "db", "upgrade", "--db", url], check=True, cwd=ROOT, capture_output=True
    )
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET synchronous_commit = off")
        for low in range(0, rows, INSERT_CHUNK_ROWS):
            high = min(rows, low + INSERT_CHUNK_ROWS)
            pending = f"i % {EVERY} = {PLANTED['not_shipped']} AND i % 2 = 1"
            conn.execute(f"""
                INSERT INTO qmq_outbox (message_id, subject, body, content_type, state, attempts, next_attempt_at,
                                        sent_at, last_error, created_at)
                SELECT {SQL_ID}, 'subject-' || (i % {SUBJECTS}), '\\x7b7d'::bytea, 'application/json',
                       CASE WHEN {pending} THEN 'pending' ELSE 'sent' END, 1, now(),
                       CASE WHEN {pending} THEN NULL ELSE to_timestamp(ms / 1000.0) + interval '50 ms' END,
                       CASE WHEN {pending} THEN 'broker down' END, to_timestamp(ms / 1000.0)
                FROM (SELECT i, ms, lpad(to_hex(ms), 12, '0') AS h
                      FROM (SELECT i, {base_ms} + i * {SPAN_MS} / {rows} AS ms
                            FROM generate_series({low}::bigint, {high - 1}) AS i) AS t) AS g""")
            print(f"  outbox: {high:,} rows", flush=True)
        conn.execute("VACUUM ANALYZE qmq_outbox")
    return time.monotonic() - started


GENERATE_LEDGER = r"""
import json, sys
from pathlib import Path
from pyspark.sql import SparkSession, functions as F
ledger, rows, base_ms, every, planted, extra, subjects, span, spark_id, database = sys.argv[1:11]
rows, base_ms, every, subjects, span = int(rows), int(base_ms), int(every), int(subjects), int(span)
planted, extra = json.loads(planted), json.loads(extra)
spark = (SparkSession.builder.master("local[2]").config("spark.driver.memory", "4g")
         .config("spark.sql.shuffle.partitions", "8").config("spark.ui.enabled", "false")
         .config("spark.ui.showConsoleProgress", "false")
         .config("spark.sql.session.timeZone", "UTC").getOrCreate())
n_extra = sum(extra.values())
ids = spark.range(0, rows + n_extra, numPartitions=8)
ms = F.expr(f"{base_ms} + (CASE WHEN id < {rows} THEN id ELSE id - {rows} END) * {span} div {rows}")
made = (ids.withColumn("ms", ms).withColumn("h", F.lower(F.lpad(F.hex("ms"), 12, "0")))
        .withColumn("message_id", F.expr(spark_id))
        .withColumn("subject", F.concat(F.lit("subject-"), (F.col("id") % subjects).cast("string")))
        .withColumn("created_at", F.timestamp_millis("ms"))
        .withColumn("stored_at", F.timestamp_millis(F.col("ms") + 20))
        .withColumn("broker", F.concat(F.lit("b"), (F.col("id") % 2).cast("string")))
        .withColumn("date", F.date_format("stored_at", "yyyy-MM-dd"))
        .withColumn("kind", F.when(F.col("id") >= rows + extra["orphaned"], "rolled_back")
                    .when(F.col("id") >= rows, "orphaned")
                    .when(F.col("id") % every == planted["not_shipped"], "not_shipped")
                    .when(F.col("id") % every == planted["not_acked"], "not_acked")
                    .when(F.col("id") % every == planted["dead_lettered"], "dead_lettered")
                    .when(F.col("id") % every == planted["redelivered"], "redelivered").otherwise("ok")))
stored = made.where(F.col("kind") != "not_shipped")
stored.select(
    "message_id", "subject", F.col("subject").alias("stored_subject"), F.lit(None).cast("string").alias("group"),
    F.lit("producer").alias("origin"), F.lit(1).alias("attempt"), F.lit(None).cast("string").alias("reason"),
    "stored_at", F.col("stored_at").alias("first_stored_at"), "created_at",
    F.when(F.col("kind") == "rolled_back", F.lit(f"outbox:{database}")).alias("producer"),
    F.lit(100).alias("size"), (F.col("id") * 200).alias("offset"), "date", "broker",
).write.partitionBy("date", "broker").mode("overwrite").parquet(f"{ledger}/messages")
kind = F.col("kind")
a = stored.select("message_id", "subject", F.lit("g-a").alias("group"), "kind", "stored_at", "date", "broker")
b = stored.where(F.col("subject").isin("subject-0", "subject-1")).select(
    "message_id", "subject", F.lit("g-b").alias("group"), F.lit("ok").alias("kind"), "stored_at", "date", "broker")
status = (F.when(kind == "not_acked", "in_flight").when(kind == "dead_lettered", "dead").otherwise("acked"))
a.unionByName(b).select(
    "message_id", "subject", "group", F.lit(False).alias("broadcast"),
    F.when(kind == "redelivered", 2).when(kind == "dead_lettered", 3).otherwise(1).alias("times_delivered"),
    F.col("stored_at").alias("first_delivered_at"), F.col("stored_at").alias("last_delivered_at"),
    F.when(status == "acked", F.col("stored_at")).alias("acked_at"), status.alias("status"),
    (status == "dead").alias("dead_lettered"), F.when(status == "dead", F.col("stored_at")).alias("dead_lettered_at"),
    F.when(kind == "dead_lettered", 3).otherwise(1).alias("attempts"), F.col("stored_at").alias("first_stored_at"),
    "date", "broker",
).write.partitionBy("date", "broker").mode("overwrite").parquet(f"{ledger}/deliveries")
groups = [(f"subject-{k}", g, False, f"b{b}") for b in (0, 1) for k in range(subjects)
          for g in (("g-a", "g-b") if k < 2 else ("g-a",))]
spark.createDataFrame(groups, "subject string, group string, broadcast boolean, broker string").select(
    "subject", "group", "broadcast", F.expr(f"timestamp_millis({base_ms} - 86400000)").alias("created_at"),
    F.lit(0).cast("long").alias("start_seq"), "broker",
).write.partitionBy("broker").mode("overwrite").parquet(f"{ledger}/groups")
spark.stop()
"""


def create_ledger(ledger: Path, rows: int, base_ms: int, database: str) -> float:
    started = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-c",
            GENERATE_LEDGER,
            str(ledger),
            str(rows),
            str(base_ms),
            str(EVERY),
            json.dumps(PLANTED),
            json.dumps(EXTRA),
            str(SUBJECTS),
            str(SPAN_MS),
            SPARK_ID,
            database,
        ],
        check=True,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable},
    )
    as_of = datetime.now(UTC)
    (ledger / "_exports").mkdir(parents=True, exist_ok=True)
    for broker in ("b0", "b1"):
        (ledger / "_exports" / f"{broker}.json").write_text(
            json.dumps(
                {
                    "name": broker,
                    "kind": "broker",
                    "as_of": as_of.isoformat(),
                    "as_of_ms": int(as_of.timestamp() * 1000),
                }
            )
        )
    return time.monotonic() - started


def extra_id(i: int, base_ms: int, rows: int) -> str:
    """A ledger-only message (i >= rows) takes the time of row i - rows, and i in the other fields."""
    h = f"{base_ms + (i - rows) * SPAN_MS // rows:012x}"
    return f"{h[:8]}-{h[8:12]}-7{i % 4096:03x}-8{(i // 4096) % 4096:03x}-{i:012x}"


def expected(rows: int, base_ms: int) -> dict[str, str]:
    """message id -> class of every anomaly planted."""
    out = {message_id(i, base_ms, rows): cls for cls, r in PLANTED.items() for i in range(r, rows, EVERY)}
    first = rows
    for cls, count in EXTRA.items():
        out.update({extra_id(i, base_ms, rows): cls for i in range(first, first + count)})
        first += count
    return out


def bench_export(messages: int) -> None:
    """`qmq ledger export` of a store holding `messages` 1 KiB messages on 10 subjects, each pulled by
    a consumer group in batches of 64 and acknowledged (as a broker journals it), in one process."""
    from qmq.broker import journal
    from qmq.broker.consumer_group import Ack, Pull
    from qmq.ledger.export import export
    from qmq.protocol import envelope
    from qmq.protocol.limits import ACTION_SUBJECT
    from qmq.store.flush import FlushMode
    from qmq.store.store import LogStore, Message, StoreConfig

    work = Path(tempfile.mkdtemp(prefix="qmq-bench-ledger-"))
    try:
        store = LogStore(work / "store", StoreConfig(flush=FlushMode.ASYNC))
        body = envelope.encode(b"x" * 1000, created_at=int(time.time() * 1000))
        seq = dict.fromkeys(range(SUBJECTS), 0)
        batch = 64
        for first in range(0, messages, batch * SUBJECTS):
            for k in range(SUBJECTS):
                count = min(batch, max(0, messages - first - k * batch))
                if not count:
                    continue
                subject = f"subject-{k}"
                store.append([Message(subject, str(uuid.uuid4()), body) for _ in range(count)])
                pulls = tuple(range(seq[k], seq[k] + count))
                entries = [
                    journal.GroupAction(subject, "g", Pull("c", seq[k], pulls, seq[k] + count)),
                    journal.GroupAction(subject, "g", Ack("c", seq[k] + count - 1)),
                ]
                if seq[k] == 0:
                    entries.insert(0, journal.Create(subject, "g", 0, False))
                store.append([Message(ACTION_SUBJECT, f"%a{first}-{k}", journal.encode(entries))])
                seq[k] += count
        store.close()
        size = sum(p.stat().st_size for p in (work / "store" / "messagelog").iterdir())
        load = os.getloadavg()[0]
        started = time.monotonic()
        report = export(work / "store", work / "ledger")
        elapsed = time.monotonic() - started
        print(
            f"ledger export: {messages:,} messages ({size / 2**20:,.0f} MiB, {report.records:,} records) in "
            f"{elapsed:.1f} s: {messages / elapsed:,.0f} messages/s (load average at start {load:.1f})"
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--keep", action="store_true", help="keep the database and files (printed)")
    parser.add_argument("--export", type=int, metavar="MESSAGES", help="time a ledger export instead")
    args = parser.parse_args()
    if args.export:
        bench_export(args.export)
        return
    yesterday = (datetime.now(UTC) - timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    base_ms = int(yesterday.timestamp() * 1000) + 3600 * 1000
    name = f"qmq_bench_{uuid.uuid4().hex[:8]}"
    url = PG_ADMIN_URL.rsplit("/", 1)[0] + "/" + name
    work = Path(tempfile.mkdtemp(prefix="qmq-bench-reconcile-"))
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        print(f"{args.rows:,} outbox rows in {name}; ledger in {work}", flush=True)
        outbox_s = create_outbox(url, args.rows, base_ms)
        ledger_s = create_ledger(work / "ledger", args.rows, base_ms, name)
        want = expected(args.rows, base_ms)
        print(f"generated: outbox {outbox_s:.0f} s, ledger {ledger_s:.0f} s; {len(want)} anomalies planted", flush=True)
        load = os.getloadavg()[0]
        started = time.monotonic()
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "qmq",
                "reconcile",
                "--outbox-db",
                url,
                "--ledger",
                str(work / "ledger"),
                "--out",
                str(work / "out"),
                "--since",
                yesterday.isoformat(),
                "--until",
                (yesterday + timedelta(days=1)).isoformat(),
                "--master",
                "local[2]",
                "--driver-memory",
                "4g",
            ],
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYSPARK_PYTHON": sys.executable},
        )
        elapsed = time.monotonic() - started
        if result.returncode not in (0, 3, 4):
            sys.exit(f"qmq reconcile failed ({result.returncode}):\n{result.stderr[-4000:]}")
        summary = json.loads((work / "out" / "summary.json").read_text())
        found = {r["message_id"]: r["class"] for r in pq.read_table(work / "out" / "anomalies").to_pylist()}
        missed = {m: c for m, c in want.items() if found.get(m) != c}
        extra = {m: c for m, c in found.items() if m not in want}
        print(
            f"reconciled {summary['total']:,} messages in {elapsed:.1f} s (load average at start "
            f"{load:.1f}, {os.cpu_count()} cores); exit code {result.returncode}"
        )
        print(
            "counts: "
            + ", ".join(
                f"{k} {summary[k]:,}"
                for k in (
                    "delivered",
                    "not_shipped",
                    "not_acked",
                    "dead_lettered",
                    "redelivered",
                    "orphaned",
                    "rolled_back",
                    "in_flight",
                )
            )
        )
        print(
            f"planted anomalies found: {len(want) - len(missed)} of {len(want)}; missed {len(missed)}, "
            f"unexpected {len(extra)}: {'PASS' if not missed and not extra else 'FAIL'}"
        )
    finally:
        if args.keep:
            print(f"kept: database {url}, files {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
            with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


if __name__ == "__main__":
    main()
