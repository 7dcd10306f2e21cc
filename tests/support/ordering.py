"""The ordering tests' cluster and what they look at (docs/ordering.md): a meta server, broker
groups registered with it, the ordered test app's tables, and checks of a key's order."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import psycopg

from qmq.client import Client, OutgoingMessage
from qmq.client.blocking import Admin
from qmq.db.migrate import upgrade
from qmq.protocol.ordering import queue_of
from tests.support.broker import ROOT, Broker, start_broker
from tests.support.databases import fresh_database
from tests.support.outbox import relay_args
from tests.support.worker import wait_ready
from tests.test_meta import log_text, start_meta, wait_until

ORDERED_APP = "tests.apps.ordered:app"
SUBJECT = "orders"
DEADLINE_S = 60.0  # what a test waits for must happen within this
GROUP = "ledger"
TABLES = """
CREATE TABLE IF NOT EXISTS ordered_entities (order_key TEXT PRIMARY KEY, seq INT NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS ordered_attempts (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL,
    order_key TEXT NOT NULL, seq INT NOT NULL, attempt INT NOT NULL, worker TEXT NOT NULL, at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS ordered_fixed (order_key TEXT PRIMARY KEY);
CREATE TABLE IF NOT EXISTS ordered_handled (id BIGSERIAL PRIMARY KEY, message_id TEXT NOT NULL,
    order_key TEXT NOT NULL, seq INT NOT NULL, worker TEXT NOT NULL, at TIMESTAMPTZ NOT NULL);
"""


@contextlib.contextmanager
def ordered_database(pg_url: str, keys: Sequence[str] = ()) -> Iterator[str]:
    """A fresh database with qmq's tables and the ordered test app's, one entity row per key."""
    with fresh_database(pg_url) as url:
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(TABLES)
            for key in keys:
                conn.execute("INSERT INTO ordered_entities (order_key) VALUES (%s)", (key,))
        yield url


TEST_LEASE_S = 5.0  # the brokers' --ordered-lease in tests: a dead worker's queues move this soon


def start_cluster(
    processes, tmp_path: Path, groups: Sequence[str], lease_s: float = TEST_LEASE_S
) -> tuple[str, list[Broker]]:
    """A meta server and one broker per group name, registered with it; returns the meta address."""
    _, meta_port = start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}")
    meta = f"127.0.0.1:{meta_port}"
    brokers = [
        start_broker(
            processes,
            tmp_path / f"broker-{g}",
            "--meta",
            meta,
            "--group",
            g,
            "--ordered-lease",
            str(lease_s),
            name=f"broker-{g}",
        )
        for g in groups
    ]
    return meta, brokers


def worker_env(meta: str, db_url: str, name: str, **extra: str) -> dict[str, str]:
    return {
        "PYTHONPATH": str(ROOT),
        "QMQ_META": "",
        "QMQ_TOKEN": "",
        "QMQ_TEST_META": meta,
        "QMQ_TEST_DB": db_url,
        "QMQ_TEST_WORKER": name,
        **extra,
    }


def start_ordered_worker(processes, meta: str, db_url: str, name: str, *flags: str, ready: bool = True, **extra: str):
    proc = processes.start(
        ["-m", "qmq", "worker", "-A", ORDERED_APP, "-l", "INFO", "-n", name, *flags],
        name=name,
        env=worker_env(meta, db_url, name, **extra),
    )
    if ready:
        wait_ready(proc)
    return proc


def start_producer(processes, db_url: str, meta: str, rounds: int, keys: Sequence[str], name: str, **env: str):
    return processes.start(
        ["-m", "tests.apps.ordered_producer", db_url, meta, SUBJECT, str(rounds), *keys],
        name=name,
        env={"PYTHONPATH": str(ROOT), "QMQ_META": "", "QMQ_TOKEN": "", **env},
    )


def rows(db_url: str, sql: str) -> list[tuple]:
    with psycopg.connect(db_url, autocommit=True) as conn:
        return conn.execute(sql).fetchall()


def handled_by_key(db_url: str) -> dict[str, list[int]]:
    """Each key's sequence numbers in the order their handlings committed."""
    out: dict[str, list[int]] = defaultdict(list)
    for key, seq in rows(db_url, "SELECT order_key, seq FROM ordered_handled ORDER BY id"):
        out[key].append(seq)
    return out


def attempts_by_key(db_url: str) -> dict[str, list[tuple[int, str]]]:
    """Each key's handler calls in the order they began: (seq, worker)."""
    out: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for key, seq, worker in rows(db_url, "SELECT order_key, seq, worker FROM ordered_attempts ORDER BY id"):
        out[key].append((seq, worker))
    return out


def order_problems(db_url: str, expected: dict[str, int]) -> list[str]:
    """What breaks the promise: for every key the handlings committed 1..n in order, once each, and
    the handler was never called for a message before an earlier one of its key (a call repeats
    only the message just before it, after a crash or a lease that moved)."""
    problems = []
    handled = handled_by_key(db_url)
    for key, n in expected.items():
        if handled.get(key, []) != list(range(1, n + 1)):
            problems.append(f"{key}: handled {handled.get(key)} instead of 1..{n}")
    for key, calls in attempts_by_key(db_url).items():
        highest = 0
        for seq, worker in calls:
            if seq not in (highest, highest + 1):
                problems.append(f"{key}: seq {seq} called (by {worker}) after {highest}")
            highest = max(highest, seq)
    return problems


def start_relay(processes, db_url: str, meta: str, name: str):
    return processes.start(
        relay_args(db_url, meta=meta), name=name, env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_DB_URL": ""}
    )


def wait_done(proc) -> None:
    wait_until(lambda: "done" in log_text(proc) or proc.poll() not in (None, 0), "the producer commits", DEADLINE_S)
    assert proc.wait(30) == 0, log_text(proc)[-3000:]


def handled_count(db_url: str) -> int:
    return rows(db_url, "SELECT count(*) FROM ordered_handled")[0][0]


def keys_in_one_queue(count: int) -> list[str]:
    """`count` keys that hash to the same logical queue."""
    by_queue: dict[int, list[str]] = {}
    for i in range(10_000):
        key = f"k-{i}"
        same = by_queue.setdefault(queue_of(key), [])
        same.append(key)
        if len(same) == count:
            return same
    raise AssertionError("unreachable")


def send_ordered(meta: str, bodies: list[dict]) -> None:
    with Client(meta=meta) as client:
        results = client.send([OutgoingMessage(SUBJECT, b, order_key=b["key"]) for b in bodies])
    assert all(r.ok for r in results), results


def dead_letters(admin: Admin, queue: str) -> list[dict]:
    answers = admin.dead_list(queue, GROUP)
    return [m for answer in answers for m in (answer.reply or {}).get("messages", [])]
