"""`--redrive` and `--redrive-dead` for real: outbox rows marked sent whose broker then lost its disk
are found `not_shipped` and put back to pending, and a real `qmq relay` ships them again; a dead
letter is sent back to its group by the broker, which then acknowledges it. The next night's
reconciliation finds everything delivered."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

import qmq
from qmq.db.engine import create_engine
from spark_etl import classify as c
from tests.support.broker import RawConsumer, restart_broker, start_broker
from tests.support.outbox import states, wait_for
from tests.support.reconcile import (
    classes_of,
    export_all,
    read_summary,
    reconcile,
    spark,  # noqa: F401 - the shared SparkSession fixture
)
from tests.support.worker import app_database
from tests.test_reconcile_scenario import start_relay


@pytest.fixture
def db_url(pg_url):
    with app_database(pg_url) as url:
        yield url


def test_lost_rows_and_dead_letters_are_driven_again(processes, tmp_path, db_url, spark) -> None:  # noqa: F811
    started = datetime.now(UTC) - timedelta(minutes=1)
    broker = start_broker(processes, tmp_path / "b1", name="b1")
    engine = create_engine(db_url)
    producer = qmq.Producer(brokers=[broker.address], engine=engine)

    @qmq.transactional(producer)
    def place(session, n: int) -> str:
        return producer.send("orders", {"n": n})

    lost = [place(n=i) for i in range(3)]
    wait_for(lambda: set(states(engine).values()) == {"sent"}, "the rows shipped")
    # The broker's disk is lost: killed, its directory gone, started again empty.
    processes.kill(broker.proc)
    shutil.rmtree(broker.data_dir)
    broker = restart_broker(processes, broker, name="b1")
    doomed = place(n=99)
    wait_for(lambda: states(engine)[doomed] == "sent", "the new row shipped")
    with broker.connect() as conn:
        consumer = RawConsumer(conn, "orders", "billing", "c1", {"start": "earliest"})
        [delivery] = consumer.pull(8)
        assert consumer.nack(delivery, 0, dead=True, reason="cannot bill")[0] == "dead"
        consumer.ack([delivery])

    export_all([broker.data_dir], tmp_path / "ledger")
    first = tmp_path / "night-1"
    findings = reconcile(
        spark,
        first,
        [db_url],
        tmp_path / "ledger",
        started,
        datetime.now(UTC),
        grace=timedelta(0),
        redrive=True,
        redrive_dead=True,
        brokers=[broker.address],
    )
    assert classes_of(first) == {**{m: c.NOT_SHIPPED for m in lost}, doomed: c.DEAD_LETTERED}
    assert findings.redrive is not None
    assert findings.redrive.outbox == {db_url.rsplit("/", 1)[1]: 3}
    assert findings.redrive.dead == [{"broker": broker.address, "subject": "orders", "group": "billing", "redriven": 1}]
    assert read_summary(first)["redrive"]["outbox"] == findings.redrive.outbox
    report = (first / "report.md").read_text()
    assert "3 outbox rows of" in report and "1 dead letters re-driven" in report
    with engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT state, sent_at, next_attempt_at <= now() FROM qmq_outbox WHERE message_id = ANY(:ids)"),
            {"ids": lost},
        ).all()
    assert rows == [("pending", None, True)] * 3

    # A relay ships them again; the group takes back its dead letter and acknowledges everything.
    start_relay(processes, db_url, [broker])
    wait_for(lambda: set(states(engine).values()) == {"sent"}, "the relay shipped the re-driven rows")
    with broker.connect() as conn:
        consumer = RawConsumer(conn, "orders", "billing", "c1")
        got = consumer.drain(4, wait_ms=500)
        assert sorted(d.id for d in got) == sorted([*lost, doomed])
    producer.close()

    export_all([broker.data_dir], tmp_path / "ledger")
    second = tmp_path / "night-2"
    findings = reconcile(spark, second, [db_url], tmp_path / "ledger", started, datetime.now(UTC), grace=timedelta(0))
    assert classes_of(second) == {doomed: c.REDELIVERED}  # received twice: before its dead letter, and after
    assert read_summary(second)["delivered"] == 3 and findings.exit_code == 0
