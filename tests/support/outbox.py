"""Outbox databases, relays and a consumer for the producer's and relay's tests: everything real (the
database, `qmq broker` and `qmq relay` processes, the qmq client)."""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from qmq.client.blocking import Client
from qmq.client.deliveries import Delivery
from qmq.outbox.schema import outbox
from tests.support.broker import ROOT
from tests.test_meta import wait_until

DELIVERY_DEADLINE_S = 30.0


def outbox_rows(engine: sa.Engine) -> dict[str, sa.Row]:
    """Every outbox row by message id."""
    with engine.connect() as conn:
        return {r.message_id: r for r in conn.execute(sa.select(outbox))}


def states(engine: sa.Engine) -> dict[str, str]:
    return {m: r.state for m, r in outbox_rows(engine).items()}


def committed_ids(engine: sa.Engine) -> set[str]:
    """The message ids another connection sees now, read outside any transaction: unlike `states`,
    this does not wait for a SQLite writer (qmq's SQLite engines begin IMMEDIATE) to finish."""
    if engine.dialect.name != "sqlite":
        return set(states(engine))
    with contextlib.closing(sqlite3.connect(engine.url.database, isolation_level=None)) as conn:
        return {r[0] for r in conn.execute("SELECT message_id FROM qmq_outbox")}


def wait_for(condition: Callable[[], Any], what: str, deadline_s: float = DELIVERY_DEADLINE_S) -> Any:
    """Poll `condition` (a state in a database or another process) until it is truthy."""
    return wait_until(condition, what, deadline_s)


def consume(
    broker: str,
    subject: str,
    expected: int,
    *,
    group: str = "tests",
    quiet_s: float = 1.0,
    deadline_s: float = DELIVERY_DEADLINE_S,
) -> list[Delivery]:
    """Every message of `subject` from the beginning (acked), until `expected` came and then nothing
    more for `quiet_s` (so that extra copies would be seen), or the deadline."""
    got: list[Delivery] = []
    deadline = time.monotonic() + deadline_s
    with Client(brokers=[broker]) as client:
        sub = client.subscribe(subject, group, start="earliest")
        quiet_until = None
        while time.monotonic() < deadline:
            batch = sub.pull(256, 0.25)
            for d in batch:
                sub.ack(d)
            got.extend(batch)
            if len(got) >= expected:
                if batch or quiet_until is None:
                    quiet_until = time.monotonic() + quiet_s
                elif time.monotonic() >= quiet_until:
                    break
        sub.close()
    return got


def relay_args(*dbs: str, broker: str | None = None, meta: str | None = None, **flags: Any) -> list[str]:
    """argv for `qmq relay` shipping to `broker` or through `meta` (fast polling, short leases unless
    `flags` say otherwise)."""
    options = {"poll-interval": 0.2, "lease": 5, **flags}
    args = ["-m", "qmq", "relay", *(["--broker", broker] if broker else ["--meta", meta])]
    for db in dbs:
        args += ["--db", db]
    for name, value in options.items():
        args += [f"--{name}"] if value is True else [f"--{name}", str(value)]
    return args


def start_relay(processes, *dbs: str, broker: str, name: str = "relay", **flags: Any):
    return processes.start(
        relay_args(*dbs, broker=broker, **flags),
        name=name,
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": "", "QMQ_DB_URL": ""},
    )
