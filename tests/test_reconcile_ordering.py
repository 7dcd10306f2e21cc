"""The reconciliation of ordered messages (docs/ordering.md), produced by really running qmq: a meta
server, two broker groups, an application committing ordered messages through its outbox, and an
ordered `qmq worker` with SQL idempotency.

A broker stores an ordered message under its queue subject `subject#queue`, while its outbox row and
its idempotency record name `subject`. The reconciliation must see one subject: every ordered message
handled is delivered, a poison one dead-lettered, and the figures per subject and per group name
`subject` (not one line per queue), with the idempotency records joined to the deliveries; and
`--redrive-dead` asks for the dead letter under the queue subject the broker keeps it in.
"""

from __future__ import annotations

import signal
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

import qmq
from qmq.db.engine import create_engine
from qmq.protocol.ordering import queue_of, queue_subject
from spark_etl import classify as c
from tests.support.ordering import (
    DEADLINE_S,
    GROUP,
    SUBJECT,
    handled_count,
    ordered_database,
    rows,
    start_cluster,
    start_ordered_worker,
)
from tests.support.outbox import states
from tests.support.reconcile import (
    export_all,
    read_anomalies,
    read_summary,
    reconcile,
    spark,  # noqa: F401 - the shared SparkSession fixture
)
from tests.support.worker import EXIT_TIMEOUT_S, log_text
from tests.test_meta import wait_until

KEYS = [f"order-{i}" for i in range(8)]
PER_KEY = 3


@pytest.fixture
def db_url(pg_url):
    with ordered_database(pg_url, [*KEYS, "poison"]) as url:
        yield url


def test_ordered_messages_are_reconciled_under_their_subject(processes, tmp_path, db_url, spark) -> None:  # noqa: F811
    started = datetime.now(UTC)
    meta, brokers = start_cluster(processes, tmp_path, ["g1", "g2"])
    worker = start_ordered_worker(processes, meta, db_url, "w1", QMQ_TEST_MAX_RETRIES="1")
    engine = create_engine(db_url)
    producer = qmq.Producer(meta=meta, engine=engine)
    sent: list[str] = []
    for seq in range(1, PER_KEY + 1):
        for key in KEYS:
            with engine.begin() as conn:
                sent.append(producer.send(SUBJECT, {"key": key, "seq": seq}, order_key=key, connection=conn))
    with engine.begin() as conn:
        poison = producer.send(
            SUBJECT, {"key": "poison", "seq": 1, "poison": True}, order_key="poison", connection=conn
        )
    with engine.begin() as conn:  # handled only once the poison message before it is dead-lettered
        sent.append(producer.send(SUBJECT, {"key": "poison", "seq": 2}, order_key="poison", connection=conn))
    assert producer.flush(30)
    producer.close()
    assert set(states(engine).values()) == {"sent"}
    wait_until(lambda: handled_count(db_url) >= len(sent), "the worker handled every ordered message", DEADLINE_S)
    consumed = rows(db_url, "SELECT DISTINCT subject FROM qmq_consumed")
    assert consumed == [(SUBJECT,)]  # the idempotency records name the subject, not the queue

    worker.send_signal(signal.SIGTERM)  # it acknowledges what it handled before it exits
    assert worker.wait(EXIT_TIMEOUT_S) == 0, log_text(worker)[-2000:]
    ledger = tmp_path / "ledger"
    export_all([b.data_dir for b in brokers], ledger)

    # The cause of the poison message is fixed; the reconciliation re-drives its dead letter, which
    # the broker keeps under the queue subject, and the next worker handles it.
    with psycopg.connect(db_url, autocommit=True) as conn:
        conn.execute("INSERT INTO ordered_fixed (order_key) VALUES ('poison')")
    out = tmp_path / "reconciliation"
    since, until = started - timedelta(minutes=1), datetime.now(UTC) + timedelta(minutes=1)
    options = {"grace": timedelta(0), "consumed_dbs": [db_url], "redrive_dead": True, "meta": meta}
    findings = reconcile(spark, out, [db_url], ledger, since, until, **options)
    assert findings.redrive is not None
    [redriven] = findings.redrive.dead
    assert redriven["subject"] == queue_subject(SUBJECT, queue_of("poison")) and redriven.get("redriven") == 1
    start_ordered_worker(processes, meta, db_url, "w2")
    wait_until(lambda: handled_count(db_url) > len(sent), "the re-driven poison message handled", DEADLINE_S)

    summary = read_summary(out)
    assert summary["total"] == len(sent) + 1
    assert {k: summary[k] for k in c.CLASSES if summary[k]} == {c.DELIVERED: len(sent), c.DEAD_LETTERED: 1}
    assert findings.per_subject == {SUBJECT: {c.DELIVERED: len(sent), c.DEAD_LETTERED: 1}}
    assert findings.per_group == [
        {
            "subject": SUBJECT,
            "group": GROUP,
            "messages": len(sent) + 1,
            "acked": len(sent),
            "not_acked": 0,
            "dead": 1,
            "redelivered": 0,  # the poison message was retried in the worker (its key waits): delivered once
        }
    ]
    [anomaly] = read_anomalies(out)
    assert anomaly["message_id"] == poison and anomaly["subject"] == SUBJECT
    assert anomaly["reason"].startswith(f"dead-lettered by {GROUP}: ")
    pairs = spark.read.parquet(str(out / "pairs")).collect()
    assert {p["subject"] for p in pairs} == {SUBJECT}
    handled = {p["message_id"] for p in pairs if p["consumed_at"] is not None}
    assert handled == set(sent)  # each idempotency record joined to its delivery
