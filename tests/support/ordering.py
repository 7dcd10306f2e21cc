"""The ordering tests' cluster and what they look at (docs/ordering.md): a meta server, broker
groups registered with it, the ordered test app's tables, and checks of a key's order."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path

import psycopg

from qmq.db.migrate import upgrade
from tests.support.broker import ROOT, Broker, start_broker
from tests.support.databases import fresh_database
from tests.support.worker import wait_ready
from tests.test_meta import start_meta

ORDERED_APP = "tests.apps.ordered:app"
SUBJECT = "orders"
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
