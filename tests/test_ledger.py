"""`qmq ledger export` against real `qmq broker` and `qmq delay-server` processes: what consumers did
(acks, a retry, a dead letter and its re-drive, a silent consumer's messages taken back, a message
left unacknowledged, a broadcast consumer) read back from the exported Parquet; exporting a live
store, by day, twice, and several stores into one ledger; the command line."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import UTC, datetime, timedelta

import pyarrow.parquet as pq
import pytest

from qmq.cli.ledger import export_store
from qmq.client import Client, OutgoingMessage
from qmq.ids import new_id
from qmq.ledger import tables as t
from qmq.protocol import envelope
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT, RawConsumer, send, start_broker
from tests.support.delay import dispatched_ids, start_delay_server
from tests.support.reconcile import read_ledger
from tests.test_meta import wait_until


def payload(created_ms: int | None = None, producer: str | None = None) -> bytes:
    return envelope.encode({"n": 1}, created_at=created_ms, headers={t.PRODUCER_HEADER: producer} if producer else None)


@pytest.fixture
def broker(processes, tmp_path):
    return start_broker(processes, tmp_path / "b1")


def ledger_export(*args: str) -> subprocess.CompletedProcess:
    """`qmq ledger export ARGS` in a process of its own, its output captured."""
    command = [sys.executable, "-m", "qmq", "ledger", "export", *args]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60)


def by_id(rows: list[dict], *keys: str) -> dict:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows}


def test_what_each_consumer_did_is_in_the_ledger_of_a_live_broker(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "b1")
    ok, retried, doomed, unacked = ids = [new_id() for _ in range(4)]
    created_ms = 1_700_000_000_000
    with broker.connect() as conn:
        assert send(conn, "orders", ids, payload=payload(created_ms, "outbox:shop"))["stored"] == 4
        billing = RawConsumer(conn, "orders", "billing", "c1", {"start": "earliest"})
        got = billing.pull(4)
        assert [d.id for d in got] == ids
        assert billing.nack(got[1], 0)[0] == "retry"
        assert billing.nack(got[2], 0, dead=True, reason="no such customer")[0] == "dead"
        billing.ack(got[:3])  # the fourth stays unacknowledged: in flight
        [again] = wait_until(lambda: billing.pull(8, 500), "the retry came due")
        assert again.id == retried and again.attempt == 2
        billing.ack([again])
        # The dead letter is sent back, delivered again and acknowledged.
        assert conn.request(RequestCode.BROKER_DEAD_REDRIVE, {"subject": "orders", "group": "billing"}) == {
            "redriven": 1
        }
        [redriven] = wait_until(lambda: billing.pull(8, 500), "the re-driven message")
        assert redriven.id == doomed
        billing.ack([redriven])
        # A second group reads everything and acks; so does a broadcast consumer.
        assert len(RawConsumer(conn, "orders", "audit", "a1", {"start": "earliest"}).drain(4)) == 4
        assert len(RawConsumer(conn, "orders", "watch", "w1", {"start": "earliest", "broadcast": True}).drain(4)) == 4

    report = export_store(broker.data_dir, tmp_path / "ledger", name="b1")  # while the broker runs
    assert report.kind == "broker" and not report.problems
    ledger = read_ledger(tmp_path / "ledger")

    originals = by_id([r for r in ledger[t.MESSAGES] if r["origin"] == t.PRODUCER], "message_id")
    assert sorted(originals) == sorted(ids)
    assert originals[ok]["subject"] == "orders" and originals[ok]["producer"] == "outbox:shop"
    assert originals[ok]["broker"] == "b1" and originals[ok]["attempt"] == 1
    assert originals[ok]["created_at"] == datetime.fromtimestamp(created_ms / 1000, UTC)
    copies = {(r["message_id"], r["origin"], r["group"]) for r in ledger[t.MESSAGES] if r["origin"] != t.PRODUCER}
    assert copies == {(retried, t.RETRY, "billing"), (doomed, t.DEAD, "billing"), (doomed, t.REDRIVEN, "billing")}
    dead_copy = next(r for r in ledger[t.MESSAGES] if r["origin"] == t.DEAD)
    assert dead_copy["reason"] == "no such customer" and dead_copy["first_stored_at"] == originals[doomed]["stored_at"]

    deliveries = by_id(ledger[t.DELIVERIES], "message_id", "group")
    billing_rows = {m: deliveries[(m, "billing")] for m in ids}
    assert {m: (r["status"], r["times_delivered"]) for m, r in billing_rows.items()} == {
        ok: (t.ACKED, 1),
        retried: (t.ACKED, 2),
        doomed: (t.ACKED, 2),
        unacked: (t.IN_FLIGHT, 1),
    }
    assert billing_rows[retried]["attempts"] == 2
    assert billing_rows[doomed]["dead_lettered_at"] is not None and not billing_rows[doomed]["dead_lettered"]
    assert billing_rows[unacked]["acked_at"] is None and billing_rows[ok]["acked_at"] is not None
    assert billing_rows[ok]["first_delivered_at"] is not None
    assert all(deliveries[(m, "audit")]["status"] == t.ACKED for m in ids)
    watchers = [r for r in ledger[t.DELIVERIES] if r["group"].startswith("watch.bc-")]
    assert len(watchers) == 4 and all(r["broadcast"] and r["status"] == t.ACKED for r in watchers)

    groups = {r["group"]: r for r in ledger[t.GROUPS]}
    assert {g for g, r in groups.items() if not r["broadcast"]} == {"billing", "audit"}
    assert all(r["subject"] == "orders" and r["created_at"] is not None for r in groups.values())


def test_silent_consumer_dead_letter_retry_pending_and_days(processes, tmp_path) -> None:
    """A silent consumer's messages given back and taken by another one, a dead letter not re-driven, a
    retry an hour ahead; files by day, replaced when exported again; a window with nothing in it."""
    broker = start_broker(processes, tmp_path / "b1", "--consumer-timeout", "1")
    silent = [new_id(), new_id()]
    dead, later, fine = rest = [new_id() for _ in range(3)]
    with broker.connect() as conn:
        send(conn, "pay", silent, payload=payload())
        assert len(RawConsumer(conn, "pay", "ledger", "c2", {"start": "earliest"}).pull(2)) == 2  # then silence
        taker = RawConsumer(conn, "pay", "ledger", "c3")
        back: list = []
        wait_until(lambda: back.extend(taker.pull(8, 500)) or len(back) == 2, "the silent consumer's messages back")
        taker.ack(back)
        send(conn, "pay", rest, payload=payload())
        got = taker.drain(3, ack=False)
        taker.nack(got[0], 0, dead=True)
        taker.nack(got[1], 3_600_000)  # due in an hour
        taker.ack(got)
    out = tmp_path / "ledger"
    export_store(broker.data_dir, out, name="b1")
    first = read_ledger(out)
    rows = {r["message_id"]: r for r in first[t.DELIVERIES]}
    assert {m: (r["status"], r["times_delivered"]) for m, r in rows.items()} == {
        silent[0]: (t.ACKED, 2),
        silent[1]: (t.ACKED, 2),
        dead: (t.DEAD_LETTERED, 1),
        later: (t.RETRYING, 1),
        fine: (t.ACKED, 1),
    }
    assert rows[dead]["dead_lettered"] and rows[dead]["dead_lettered_at"] is not None
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    assert {r["date"] for r in first[t.MESSAGES]} == {today}

    export_store(broker.data_dir, out, name="b1")  # again: the day's file is replaced, not added to
    assert len(read_ledger(out)[t.MESSAGES]) == len(first[t.MESSAGES])
    report = export_store(broker.data_dir, tmp_path / "empty", name="b1", until=datetime.now(UTC) - timedelta(days=1))
    assert report.rows[t.MESSAGES] == {} and report.rows[t.DELIVERIES] == {}
    exported = json.loads((out / t.EXPORTS_DIR / "b1.json").read_text())
    assert exported["kind"] == "broker" and exported["as_of_ms"] >= rows[fine]["acked_at"].timestamp() * 1000


def test_two_stores_into_one_ledger_and_the_command_line(processes, broker, tmp_path) -> None:
    b2 = start_broker(processes, tmp_path / "b2")
    ids = {b.data_dir.name: [new_id(), new_id()] for b in (broker, b2)}
    for b in (broker, b2):
        with b.connect() as conn:
            send(conn, "ship", ids[b.data_dir.name], payload=payload())
    out = tmp_path / "ledger"
    for b in (broker, b2):
        result = ledger_export("--data-dir", str(b.data_dir), "--out", str(out), "--since", "yesterday")
        assert result.returncode == 0, result.stderr
        summary = json.loads(result.stdout)
        assert summary["name"] == b.data_dir.name and summary["rows"][t.MESSAGES] == 2
    ledger = read_ledger(out)
    assert sorted((r["broker"], r["message_id"]) for r in ledger[t.MESSAGES]) == sorted(
        (name, m) for name, ms in ids.items() for m in ms
    )

    bad = ledger_export("--data-dir", str(tmp_path), "--out", str(out))
    assert bad.returncode == 2 and "is not a qmq store" in bad.stderr
    bad = ledger_export("--data-dir", str(b2.data_dir), "--out", str(out), "--since", "last tuesday")
    assert bad.returncode == 2 and "is not a time" in bad.stderr


def test_a_delay_servers_ledger(processes, broker, tmp_path) -> None:
    server = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    now = datetime.now(UTC)
    soon = OutgoingMessage("remind", {"n": 1}, deliver_at=now + timedelta(milliseconds=300))
    later = OutgoingMessage("remind", {"n": 2}, deliver_at=now + timedelta(hours=1))
    dropped = OutgoingMessage("remind", {"n": 3}, deliver_at=now + timedelta(hours=2))
    with Client(brokers=[broker.address], delay_servers=[server.address]) as client:
        assert all(r.ok for r in client.send([soon, later, dropped]))
        assert client.cancel([dropped.id]) == {dropped.id: "cancelled"}
    with broker.connect() as conn:
        arrived = wait_until(
            lambda: RawConsumer(conn, "remind", "g", "c", {"start": "earliest"}).pull(1, 500),
            "the message due soon reached the broker",
        )
    assert [d.id for d in arrived] == [soon.id]
    wait_until(lambda: soon.id in dispatched_ids(server.data_dir), "the dispatch is on disk")

    export_store(server.data_dir, tmp_path / "ledger", name="d1")
    rows = {r["message_id"]: r for r in read_ledger(tmp_path / "ledger")[t.DELAYED]}
    assert set(rows) == {soon.id, later.id, dropped.id}
    assert {m: (r["dispatched"], r["cancelled"]) for m, r in rows.items()} == {
        soon.id: (True, False),
        later.id: (False, False),
        dropped.id: (False, True),
    }
    assert rows[later.id]["due_at"] == datetime.fromtimestamp(later.deliver_at / 1000, UTC)
    assert rows[soon.id]["server"] == "d1"


def test_a_torn_tail_is_left_for_the_next_export(tmp_path) -> None:
    """A record being written at the very end (as on a live store) is not an error and not exported."""
    from qmq.store.store import LogStore, Message

    store = LogStore(tmp_path / "store")
    store.append([Message("orders", m, payload()) for m in ("a", "b")])
    store.close()
    segment = sorted((tmp_path / "store" / "messagelog").iterdir())[0]
    data = segment.read_bytes()
    with open(segment, "ab") as f:
        f.write(data[: len(data) // 2 - 5])  # half a record after the two
    report = export_store(tmp_path / "store", tmp_path / "ledger")
    assert not report.problems and report.notes
    assert sorted(r["message_id"] for r in read_ledger(tmp_path / "ledger")[t.MESSAGES]) == ["a", "b"]
    assert pq.read_table(next((tmp_path / "ledger" / t.MESSAGES).rglob("*.parquet"))).num_rows == 2


def test_a_day_partly_removed_by_retention_keeps_its_earlier_export(tmp_path) -> None:
    """Retention deletes a store's oldest segments: a later export neither replaces the fuller file
    written before, nor trips on journal entries about messages that are gone."""
    from qmq.broker import journal
    from qmq.broker.consumer_group import Ack, Pull
    from qmq.protocol.limits import ACTION_SUBJECT
    from qmq.store.store import LogStore, Message
    from tests.support.stores import SMALL

    store = LogStore(tmp_path / "store", SMALL)  # 64 KiB segments
    ids = [new_id() for _ in range(200)]
    for i in range(0, 200, 20):
        store.append([Message("orders", m, payload() + bytes(1000)) for m in ids[i : i + 20]])
    store.append(
        [
            Message(
                ACTION_SUBJECT,
                "%a0",
                journal.encode(
                    [
                        journal.Create("orders", "g", 0, False),
                        journal.GroupAction("orders", "g", Pull("c", 0, tuple(range(200)), 200)),
                        journal.GroupAction("orders", "g", Ack("c", 199)),
                    ]
                ),
            )
        ]
    )
    store.close()
    out = tmp_path / "ledger"
    export_store(tmp_path / "store", out, name="b")
    assert len(read_ledger(out)[t.MESSAGES]) == 200
    assert {r["status"] for r in read_ledger(out)[t.DELIVERIES]} == {t.ACKED}

    segments = sorted((tmp_path / "store" / "messagelog").iterdir())
    assert len(segments) > 2
    segments[0].unlink()  # as the cleaner does after the retention
    report = export_store(tmp_path / "store", out, name="b")
    assert report.kept_days == [datetime.now(UTC).strftime("%Y-%m-%d")] and not report.problems
    assert len(read_ledger(out)[t.MESSAGES]) == 200  # the fuller file stayed
    fresh = tmp_path / "fresh"
    export_store(tmp_path / "store", fresh, name="b")  # no earlier file: what is left is written
    left = read_ledger(fresh)
    assert 0 < len(left[t.MESSAGES]) < 200
    assert {r["message_id"] for r in left[t.DELIVERIES]} == {r["message_id"] for r in left[t.MESSAGES]}
