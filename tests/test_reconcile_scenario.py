"""The reconciliation of a scenario produced by really running qmq: an application committing through
`@qmq.transactional` on PostgreSQL, `qmq relay`, two `qmq broker` processes and a `qmq worker` with
SQL idempotency, with deliberate faults:

- rows committed while no broker or relay runs                 -> not_shipped
- a group (`audit`) that never acknowledges some messages     -> not_acked
- a handler that always fails                                 -> dead_lettered
- a forced duplicate delivery (the outbox row's "sent" lost, as when the database goes away right
  after a send: the relay ships it again; the worker's idempotency record absorbs the repeat)
                                                              -> redelivered
- a message sent outside a transaction                        -> orphaned

plus a rolled-back transaction (its message must exist nowhere) and a row committed after the ledger
was exported (in flight, not reported). The report must name exactly those message ids in those
classes, and nothing else.
"""

from __future__ import annotations

import signal
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

import qmq
from qmq.client import Client
from qmq.db.engine import create_engine
from spark_etl import classify as c
from tests.support.broker import ROOT, start_broker
from tests.support.outbox import states
from tests.support.reconcile import (
    classes_of,
    export_all,
    read_anomalies,
    read_summary,
    reconcile,
    spark,  # noqa: F401 - the shared SparkSession fixture
)
from tests.support.worker import (
    EXIT_TIMEOUT_S,
    app_database,
    group_totals,
    handled,
    log_text,
    query,
    start_worker,
    wait_for,
)

NORMAL, SHIPMENTS, LATE = 12, 5, 3


@pytest.fixture
def db_url(pg_url):
    with app_database(pg_url) as url:
        yield url


def start_relay(processes, db_url: str, brokers) -> object:
    args = ["-m", "qmq", "relay", "--db", db_url, "--poll-interval", "0.2", "--lease", "5"]
    for broker in brokers:
        args += ["--broker", broker.address]
    return processes.start(
        args, name="relay", env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": "", "QMQ_DB_URL": ""}
    )


def test_the_report_names_exactly_the_faults(processes, tmp_path, db_url, spark) -> None:  # noqa: F811
    started = datetime.now(UTC)
    brokers = [start_broker(processes, tmp_path / name, name=name) for name in ("b1", "b2")]
    relay = start_relay(processes, db_url, brokers)
    worker = start_worker(
        processes,
        brokers,
        db_url,
        "-c",
        "4",
        name="worker",
        env={"QMQ_TEST_IDEMPOTENT": "sql", "QMQ_TEST_MAX_RETRIES": "1"},
    )
    engine = create_engine(db_url)
    producer = qmq.Producer(brokers=[b.address for b in brokers], engine=engine)

    @qmq.transactional(producer)
    def place(session, subject: str, body) -> str:
        session.execute(sa.text("SELECT 1"))  # the application's own work would be here
        return producer.send(subject, body)

    rolled_back: list[str] = []

    @qmq.transactional(producer)
    def place_and_fail(session) -> None:
        rolled_back.append(producer.send("work", {"n": "rolled back"}))
        raise RuntimeError("a business rule said no")

    normal = [place(subject="work", body={"n": i}) for i in range(NORMAL)]
    doomed = place(subject="work", body={"always_fail": True})
    duplicate = place(subject="work", body={"n": "twice"})
    shipments = [place(subject="shipments", body={"n": i}) for i in range(SHIPMENTS)]
    with pytest.raises(RuntimeError):
        place_and_fail()
    with Client(brokers=[b.address for b in brokers]) as client:
        orphan = client.send_one("work", {"n": "no outbox"}).message_id

    # The audit group reads every shipment and acknowledges all but the last of each broker's stream;
    # closing gives those back to the group (BROKER_LEAVE), where they wait in its retry subject.
    unacked: list[str] = []
    with Client(brokers=[b.address for b in brokers]) as client:
        sub = client.subscribe("shipments", "audit", start="earliest")
        got: list = []
        wait_for(lambda: got.extend(sub.pull(16, 0.5)) or len(got) >= SHIPMENTS, "the audit group got the shipments")
        streams = defaultdict(list)
        for delivery in got:
            streams[(delivery.broker, delivery.stored_subject)].append(delivery)
        for stream in streams.values():
            stream.sort(key=lambda d: d.pull_seq)
            for delivery in stream[:-1]:
                sub.ack(delivery)
            unacked.append(stream[-1].id)
        sub.close()

    wait_for(lambda: set(states(engine).values()) == {"sent"}, "the relay and sender shipped every row")
    wait_for(lambda: {row[0] for row in handled(db_url)} >= {*normal, duplicate, orphan}, "the worker handled them")
    # The duplicate: its row's "sent" is lost (as when the database goes away right after a send), so
    # the relay ships it again.
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE qmq_outbox SET state = 'pending', sent_at = NULL, next_attempt_at = now(), "
                "lease_token = NULL, lease_expires_at = NULL WHERE message_id = :m"
            ),
            {"m": duplicate},
        )
    wait_for(lambda: states(engine)[duplicate] == "sent", "the duplicate shipped again")
    settled = {"backlog": 0, "in_flight": 0, "retrying": 0, "dead": 1}
    wait_for(lambda: group_totals(brokers, "work", "recorder") == settled, "the worker settled everything")

    # Everything stops; then rows are committed with no broker and no relay to ship them.
    for proc in (worker, relay, *(b.proc for b in brokers)):
        proc.send_signal(signal.SIGTERM)
    for proc in (worker, relay, *(b.proc for b in brokers)):
        assert proc.wait(EXIT_TIMEOUT_S) == 0, log_text(proc)[-2000:]
    late = [place(subject="work", body={"n": f"late {i}"}) for i in range(LATE)]
    assert producer.flush(30)
    export_all([b.data_dir for b in brokers], tmp_path / "ledger")
    young = place(subject="work", body={"n": "after the export"})  # in flight: made after the ledger
    producer.close()

    out = tmp_path / "reconciliation"
    findings = reconcile(
        spark,
        out,
        [db_url],
        tmp_path / "ledger",
        started - timedelta(minutes=1),
        datetime.now(UTC) + timedelta(minutes=1),
        grace=timedelta(0),
        consumed_dbs=[db_url],
    )

    expected = {
        **{m: c.NOT_SHIPPED for m in late},
        **{m: c.NOT_ACKED for m in unacked},
        doomed: c.DEAD_LETTERED,
        duplicate: c.REDELIVERED,
        orphan: c.ORPHANED,
    }
    assert classes_of(out) == expected
    summary = read_summary(out)
    everything = [*normal, doomed, duplicate, *shipments, orphan, *late, young]
    assert summary["total"] == len(everything)
    assert {k: summary[k] for k in c.CLASSES} == {
        c.DELIVERED: NORMAL + SHIPMENTS - len(unacked),
        c.NOT_SHIPPED: LATE,
        c.NOT_ACKED: len(unacked),
        c.DEAD_LETTERED: 1,
        c.REDELIVERED: 1,
        c.ORPHANED: 1,
        c.IN_FLIGHT: 1,
        c.CANCELLED: 0,
        c.ROLLED_BACK: 0,
    }
    assert findings.exit_code == 3 and summary["exceeded"] == [c.NOT_SHIPPED, c.NOT_ACKED]
    classified = {r["message_id"]: r for r in spark.read.parquet(str(out / "classified")).collect()}
    assert set(classified) == set(everything) and rolled_back[0] not in classified
    assert classified[young]["class"] == c.IN_FLIGHT

    reasons = {r["message_id"]: r["reason"] for r in read_anomalies(out)}
    assert all(reasons[m].startswith("pending in ") and "after 1 attempts" in reasons[m] for m in late)
    assert all(reasons[m] == "not acknowledged by audit (retrying after attempt 1)" for m in unacked)
    assert reasons[doomed].startswith("dead-lettered by recorder: ")
    assert "recorder 2x, the repeat absorbed by its idempotency record" in reasons[duplicate]
    assert "stored 2 times" in reasons[duplicate]
    assert reasons[orphan] == "stored with no outbox row: sent outside a transaction"
    assert query(db_url, "SELECT count(*) FROM qmq_consumed WHERE message_id = %s", duplicate) == [(1,)]

    per_group = {(g["subject"], g["group"]): g for g in findings.per_group}
    assert per_group[("shipments", "audit")] == {
        "subject": "shipments",
        "group": "audit",
        "messages": SHIPMENTS,
        "acked": SHIPMENTS - len(unacked),
        "not_acked": len(unacked),
        "dead": 0,
        "redelivered": 0,
    }
    # Received twice: the duplicate, and the failing message (its retry).
    assert per_group[("work", "recorder")]["dead"] == 1 and per_group[("work", "recorder")]["redelivered"] == 2
    report = (out / "report.md").read_text()
    assert all(m in report for m in expected) and "**FAILED**: not_shipped, not_acked over the threshold" in report
    assert (out / "anomalies.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    ledger_stores = {s["name"] for s in findings.sources["stores"]}
    assert ledger_stores == {"b1", "b2"}
