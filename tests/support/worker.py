"""`qmq worker` as a real process for tests, over the test app tests/apps/recorder.py, and what tests
look at afterwards: the app's tables in PostgreSQL and the broker's view of a consumer group."""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import psycopg

from qmq.client import Client, OutgoingMessage
from qmq.db.migrate import upgrade
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT, Broker
from tests.support.databases import fresh_database
from tests.test_meta import log_text, wait_until

READY_TIMEOUT_S = 60.0
WAIT_TIMEOUT_S = 60.0  # what a test waits for must happen within this
EXIT_TIMEOUT_S = 30.0
RECORDER = "tests.apps.recorder:app"
SUBJECT = "work"
GROUP = "recorder"
# The test app's tables (tests/apps/recorder.py).
TABLES = """
CREATE TABLE IF NOT EXISTS worker_attempts (message_id TEXT NOT NULL, attempts INT NOT NULL, worker TEXT NOT NULL,
                                            at TIMESTAMPTZ NOT NULL);
CREATE TABLE IF NOT EXISTS worker_handled (message_id TEXT NOT NULL, attempts INT NOT NULL, worker TEXT NOT NULL,
                                           handled_at TIMESTAMPTZ NOT NULL);
"""


@contextlib.contextmanager
def app_database(pg_url: str) -> Iterator[str]:
    """A fresh database with qmq's tables (`qmq db upgrade`, as an app does) and the test app's."""
    with fresh_database(pg_url) as url:
        upgrade(url)
        query_autocommit(url, TABLES)
        yield url


def query_autocommit(db_url: str, sql: str) -> None:
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute(sql)


def wait_for(condition: Callable[[], Any], what: str, timeout_s: float = WAIT_TIMEOUT_S) -> Any:
    """Poll another process's state (its tables, its log, the broker's counts): no event to wait on."""
    return wait_until(condition, what, timeout_s)


def start_worker(
    processes,
    brokers: Sequence[Broker],
    db_url: str,
    *flags: str,
    name: str = "worker",
    env: dict[str, str] | None = None,
    app: str = RECORDER,
    ready: bool = True,
):
    """`qmq worker -A app -l INFO *flags` for the test app; returns once it says it is ready."""
    settings = {
        "PYTHONPATH": str(ROOT),
        "QMQ_META": "",
        "QMQ_TOKEN": "",
        "QMQ_TEST_DB": db_url,
        "QMQ_TEST_BROKERS": ",".join(b.address for b in brokers),
        "QMQ_TEST_WORKER": name,
        **(env or {}),
    }
    proc = processes.start(
        ["-m", "qmq", "worker", "-A", app, "-l", "INFO", "-n", name, *flags], name=name, env=settings
    )
    if ready:
        wait_ready(proc)
    return proc


def wait_ready(proc) -> None:
    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"worker exited with {proc.returncode}:\n{log_text(proc)[-3000:]}")
        return " ready: " in log_text(proc)

    wait_for(ready, "the worker is ready", READY_TIMEOUT_S)


def send_bodies(
    brokers: Sequence[Broker], bodies: Sequence[Any], subject: str = SUBJECT, ids: Sequence[str] | None = None
) -> list[str]:
    """Send one message per body (with the given ids, when given); returns their ids."""
    messages = [OutgoingMessage(subject, body, **({"id": ids[i]} if ids else {})) for i, body in enumerate(bodies)]
    with Client(brokers=[b.address for b in brokers], client_id="worker-test") as client:
        results = client.send(messages)
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]
    return [r.message_id for r in results]


def query(db_url: str, sql: str, *params: Any) -> list[tuple]:
    with psycopg.connect(db_url) as conn:
        return conn.execute(sql, params).fetchall()


def handled(db_url: str) -> list[tuple[str, int, str]]:
    """(message id, attempts, worker) of every committed handling."""
    return [tuple(r) for r in query(db_url, "SELECT message_id, attempts, worker FROM worker_handled")]


def handled_count(db_url: str) -> int:
    return query(db_url, "SELECT count(*) FROM worker_handled")[0][0]


def group_totals(brokers: Sequence[Broker], subject: str = SUBJECT, group: str = GROUP) -> dict[str, int]:
    """backlog, in_flight, retrying and dead of a consumer group, summed over the brokers."""
    totals = {"backlog": 0, "in_flight": 0, "retrying": 0, "dead": 0}
    for broker in brokers:
        with broker.connect() as conn:
            stats = conn.request(RequestCode.BROKER_STATS, {})
        for item in stats["groups"]:
            if item["subject"] == subject and item["group"] == group:
                for key in totals:
                    totals[key] += item[key]
    return totals


def dead_letters(broker: Broker, subject: str = SUBJECT, group: str = GROUP) -> list[dict[str, Any]]:
    with broker.connect() as conn:
        return conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": subject, "group": group})["messages"]


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as reply:
            return reply.status, reply.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def metric(port: int, name: str) -> float:
    """The value of one sample (summed over its labels) on the worker's /metrics."""
    _, text = http_get(port, "/metrics")
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    )
