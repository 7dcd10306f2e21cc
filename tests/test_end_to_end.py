"""The whole path on real processes: `@qmq.transactional` in a Flask app on PostgreSQL, the relay, a
meta server routing to two broker groups, the delay server, two workers with SQL idempotency; a
broker, a worker and the relay are SIGKILLed and restarted while orders come in. Afterwards every
committed order has its effects exactly once, and the reconciliation accounts for every message as
delivered."""

from __future__ import annotations

import json
import signal
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from flask import Flask, abort
from flask_sqlalchemy import SQLAlchemy

import qmq
from qmq.db.migrate import upgrade
from qmq.db.url import normalize_url
from tests.apps.shop_e2e_tables import invoices, metadata, reminders
from tests.support.broker import ROOT, restart_broker, start_broker
from tests.support.databases import fresh_database
from tests.support.delay import start_delay_server
from tests.support.outbox import relay_args, wait_for
from tests.support.reconcile import export_all, reconcile, spark  # noqa: F401 - the shared SparkSession
from tests.test_meta import start_meta

ORDERS = 240
DECLINE_EVERY = 7  # payment declined: rolled back, no message may exist
REMIND_EVERY = 5  # also a reminder, delayed by REMIND_AFTER_S
REMIND_AFTER_S = 2.0
# (orders placed, what happens then)
FAULTS = {
    40: "kill broker a",
    80: "restart broker a",
    110: "kill worker 1",
    150: "restart worker 1",
    170: "kill relay",
    200: "restart relay",
}
SETTLE_DEADLINE_S = 120.0


@pytest.fixture
def db_url(pg_url):
    with fresh_database(pg_url) as url:
        upgrade(url)
        engine = sa.create_engine(normalize_url(url))
        metadata.create_all(engine)
        engine.dispose()
        yield url


def shop(db_url: str, meta: str) -> tuple[Flask, qmq.Producer]:
    app = Flask("e2e-shop")
    app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(db_url)
    db = SQLAlchemy(app)
    orders = sa.Table("e2e_orders", db.metadata, sa.Column("id", sa.Integer, primary_key=True))
    # A short insert lease, so that the messages of the relay's outage are not held up long.
    producer = qmq.Producer(meta=meta, session=db.session, insert_lease_s=3.0)

    @app.post("/orders/<int:order_id>")
    @qmq.transactional(producer)
    def place_order(order_id: int):
        db.session.execute(orders.insert().values(id=order_id))
        producer.send("order.created", {"id": order_id}, key=str(order_id))
        if order_id % REMIND_EVERY == 0:
            producer.send("order.reminder", {"id": order_id}, delay=REMIND_AFTER_S)
        if order_id % DECLINE_EVERY == 0:
            abort(409)
        return {"ok": True}

    with app.app_context():
        orders.create(db.engine)
    return app, producer


def worker_args(n: int) -> list[str]:
    return ["-m", "qmq", "worker", "-A", "tests.apps.shop_e2e:app", "-c", "4", "-n", f"e2e-{n}", "-l", "INFO"]


def test_every_committed_message_is_delivered_through_the_faults(processes, tmp_path, db_url, spark) -> None:  # noqa: F811
    started = datetime.now(UTC) - timedelta(seconds=5)
    _, meta_port = start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}")
    meta = f"127.0.0.1:{meta_port}"
    brokers = {
        g: start_broker(processes, tmp_path / g, "--meta", meta, "--group", g, name=f"broker-{g}") for g in ("a", "b")
    }
    delay = start_delay_server(processes, tmp_path / "delay", "--meta", meta)
    env = {"PYTHONPATH": str(ROOT), "QMQ_META": meta, "QMQ_DB_URL": db_url, "QMQ_TOKEN": ""}
    relay_argv = relay_args(db_url, meta=meta, lease=3)
    relay = processes.start(relay_argv, name="relay", env=env)
    workers = [processes.start(worker_args(n), name=f"worker-{n}", env=env) for n in range(2)]
    for w in workers:
        wait_for(lambda w=w: " ready: " in w.log_path.read_text(errors="replace"), "worker ready", 60)

    app, producer = shop(db_url, meta)
    client = app.test_client()
    committed, reminded = [], []
    for order_id in range(1, ORDERS + 1):
        status = client.post(f"/orders/{order_id}").status_code
        assert status == (409 if order_id % DECLINE_EVERY == 0 else 200), order_id
        if status == 200:
            committed.append(order_id)
            if order_id % REMIND_EVERY == 0:
                reminded.append(order_id)
        fault = FAULTS.get(order_id)
        if fault == "kill broker a":
            processes.kill(brokers["a"].proc)
        elif fault == "restart broker a":
            brokers["a"] = restart_broker(processes, brokers["a"], name="broker-a-again")
        elif fault == "kill worker 1":
            processes.kill(workers[1])
        elif fault == "restart worker 1":
            workers[1] = processes.start(worker_args(1), name="worker-1-again", env=env)
        elif fault == "kill relay":
            processes.kill(relay)
        elif fault == "restart relay":
            relay = processes.start(relay_argv, name="relay-again", env=env)
    assert producer.flush(30)
    producer.close()

    engine = sa.create_engine(normalize_url(db_url))

    def effects() -> tuple[list[int], list[int]]:
        with engine.connect() as conn:
            billed = sorted(conn.execute(sa.select(invoices.c.order_id)).scalars())
            remind = sorted(conn.execute(sa.select(reminders.c.order_id)).scalars())
        return billed, remind

    wait_for(
        lambda: effects() == (committed, reminded),
        "every committed order billed once and reminded once",
        SETTLE_DEADLINE_S,
    )
    for proc in workers:  # warm shutdown: their last acknowledgements reach the brokers
        assert processes.kill(proc, signal.SIGTERM) == 0
    for proc in (relay, delay.proc, brokers["a"].proc, brokers["b"].proc):
        processes.kill(proc, signal.SIGTERM)
    assert effects() == (committed, reminded)  # exactly once, though deliveries repeated after the SIGKILLs
    engine.dispose()

    export_all([tmp_path / "a", tmp_path / "b", tmp_path / "delay"], tmp_path / "ledger")
    out = tmp_path / "reconciliation"
    reconcile(
        spark,
        out,
        [db_url],
        tmp_path / "ledger",
        started,
        datetime.now(UTC) + timedelta(seconds=1),
        consumed_dbs=[db_url],
        grace=timedelta(0),
    )
    summary = json.loads((out / "summary.json").read_text())
    expected = len(committed) + len(reminded)
    assert summary["total"] == expected
    assert summary["delivered"] + summary["redelivered"] == expected, summary
    for anomaly in ("not_shipped", "not_acked", "dead_lettered", "orphaned", "rolled_back", "in_flight"):
        assert summary[anomaly] == 0, (anomaly, summary)
