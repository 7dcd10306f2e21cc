"""The broker's consumption model on a real `qmq broker` process: shared cursors, no overlap between
healthy consumers, silent consumers losing their messages to the group, 70 groups on one subject,
tags, broadcast, earliest/latest, reset, retries with delays, dead letters and re-drive, long
polling, and SIGKILLs of the broker during produce and consume."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteError
from tests.support.broker import ROOT, Broker, RawConsumer, restart_broker, send, start_broker

SILENT_TIMEOUT_S = 1.0  # --consumer-timeout in the tests that need it to pass


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:06d}" for i in range(n)]


def consumer(broker: Broker, subject: str, group: str, name: str, **options) -> RawConsumer:
    return RawConsumer(broker.connect(client_id=name), subject, group, name, options)


@pytest.fixture
def broker(processes, tmp_path) -> Broker:
    return start_broker(processes, tmp_path / "broker", "--consumer-timeout", str(SILENT_TIMEOUT_S))


def test_two_consumers_share_a_backlog_without_overlap(broker):
    a = consumer(broker, "orders", "billing", "a", start="earliest")
    b = consumer(broker, "orders", "billing", "b", start="earliest")
    conn = broker.connect()
    sent = ids("m", 10_000)
    for i in range(0, len(sent), 500):
        assert send(conn, "orders", sent[i : i + 500])["stored"] == 500
    got: dict[str, list[str]] = {"a": [], "b": []}

    def run(c: RawConsumer) -> None:
        got[c.consumer] = [d.id for d in c.drain(len(sent), max_count=100, wait_ms=300)]

    threads = [threading.Thread(target=run, args=(c,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not set(got["a"]) & set(got["b"]), "a message went to both healthy consumers"
    assert sorted(got["a"] + got["b"]) == sent
    assert got["a"] and got["b"], "one consumer got nothing: the backlog was not shared"


def test_silent_consumer_loses_its_unacked_messages_to_the_group(processes, broker):
    conn = broker.connect()
    send(conn, "orders", ids("m", 50))
    # A consumer process pulls 20 messages, never acks them, and is SIGKILLed.
    script = (
        "import sys, json; sys.path.insert(0, sys.argv[1]);"
        "from tests.support.broker import RawConsumer; from qmq.net.client import BlockingConnection;"
        "c = RawConsumer(BlockingConnection.open('127.0.0.1', int(sys.argv[2])), 'orders', 'billing', 'doomed',"
        " {'start': 'earliest'});"
        "print(json.dumps([d.id for d in c.pull(20)]), flush=True); import time; time.sleep(600)"
    )
    doomed = processes.start(["-c", script, str(ROOT), str(broker.port)], name="doomed", stdout=subprocess.PIPE)
    held = json.loads(doomed.stdout.readline())
    assert len(held) == 20
    processes.kill(doomed)
    survivor = consumer(broker, "orders", "billing", "survivor")
    # The survivor gets what was never handed out; after the timeout, the dead consumer's 20 come back
    # through the retry subject (in the same pulls, if the timeout passes while it drains: a slow machine).
    got = survivor.drain(50, wait_ms=int(SILENT_TIMEOUT_S * 1000), empty_pulls=20)
    assert sorted(d.id for d in got if d.stored_subject == "orders") == ids("m", 50)[20:]
    redelivered = [d for d in got if d.stored_subject != "orders"]
    assert sorted(d.id for d in redelivered) == sorted(held)
    assert {d.stored_subject for d in redelivered} == {"%RETRY%orders%billing"}
    assert {d.attempt for d in redelivered} == {2}
    assert not survivor.pull(10, wait_ms=0)


def test_restarted_consumer_gets_its_own_unacked_messages_first(broker):
    conn = broker.connect()
    send(conn, "orders", ids("m", 30))
    first = consumer(broker, "orders", "g", "c1", start="earliest")
    held = first.pull(10)
    first.ack(held[:4])  # acks pull seqs 0-3
    again = consumer(broker, "orders", "g", "c1", start="earliest")  # same id, no memory: like a restart
    resent = again.pull(64)
    assert [d.id for d in resent] == [d.id for d in held[4:]]
    other = consumer(broker, "orders", "g", "c2")
    assert [d.id for d in other.pull(64, wait_ms=0)] == ids("m", 30)[10:]


def test_seventy_groups_each_receive_every_message(broker):
    conn = broker.connect()
    sent = ids("m", 300)
    groups = [consumer(broker, "orders", f"group-{n:02d}", f"c{n}", start="earliest") for n in range(70)]
    for i in range(0, 300, 100):
        send(conn, "orders", sent[i : i + 100])
    for c in groups:
        assert [d.id for d in c.drain(300, wait_ms=200)] == sent, c.group
    stats = conn.request(RequestCode.BROKER_STATS, {})
    assert len(stats["groups"]) == 70
    assert all(g["backlog"] == 0 and g["in_flight"] == 0 for g in stats["groups"])


def test_tags_any_and_all(broker):
    conn = broker.connect()
    send(conn, "orders", ["plain"])
    send(conn, "orders", ["new"], tags=["new"])
    send(conn, "orders", ["vip"], tags=["vip"])
    send(conn, "orders", ["new-vip"], tags=["new", "vip"])
    any_ = consumer(broker, "orders", "any", "c", start="earliest", tags=["new", "vip"])
    all_ = consumer(broker, "orders", "all", "c", start="earliest", tags=["new", "vip"], match_all=True)
    assert [d.id for d in any_.drain(3, wait_ms=100)] == ["new", "vip", "new-vip"]
    assert [d.id for d in all_.drain(1, wait_ms=100)] == ["new-vip"]


def test_broadcast_gives_every_consumer_every_message(broker):
    conn = broker.connect()
    a = consumer(broker, "prices", "cache", "host-a", broadcast=True, start="earliest")
    b = consumer(broker, "prices", "cache", "host-b", broadcast=True, start="earliest")
    shared = consumer(broker, "prices", "cache", "host-c")  # the same group name, clustering
    send(conn, "prices", ids("p", 40))
    assert [d.id for d in a.drain(40, wait_ms=200)] == ids("p", 40)
    assert [d.id for d in b.drain(40, wait_ms=200)] == ids("p", 40)
    assert len(shared.drain(40, wait_ms=200)) == 0  # created at the latest, after the sends
    retried = a.pull(1, wait_ms=0)
    assert retried == []


def test_new_group_starts_at_latest_unless_asked_for_earliest_and_reset(broker):
    conn = broker.connect()
    send(conn, "orders", ids("old", 5))
    latest = consumer(broker, "orders", "late", "c")
    earliest = consumer(broker, "orders", "early", "c", start="earliest")
    assert latest.pull(10, wait_ms=0) == []
    send(conn, "orders", ids("new", 3))
    assert [d.id for d in latest.drain(3, wait_ms=100)] == ids("new", 3)
    assert [d.id for d in earliest.drain(8, wait_ms=100)] == ids("old", 5) + ids("new", 3)
    assert conn.request(RequestCode.BROKER_RESET, {"subject": "orders", "group": "late", "to": "earliest"}) == {
        "cursor": 0
    }
    assert [d.id for d in latest.drain(8, wait_ms=100)] == ids("old", 5) + ids("new", 3)
    assert conn.request(RequestCode.BROKER_RESET, {"subject": "orders", "group": "late", "to": 6})["cursor"] == 6
    assert [d.id for d in latest.drain(8, wait_ms=100)] == ids("new", 3)[1:]


def test_failing_message_is_retried_with_its_delays_then_dead_lettered(broker):
    conn = broker.connect()
    c = consumer(broker, "orders", "billing", "c", start="earliest")
    send(conn, "orders", ["poison", *ids("ok", 20)])
    delays_ms = [300, 600, 900]
    attempts: list[tuple[int, float]] = []
    ok: list[str] = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        batch = c.pull(8, wait_ms=2000)
        for d in batch:
            if d.id == "poison":
                attempts.append((d.attempt, time.monotonic()))
                n = d.attempt
                outcome = c.nack(d, delays_ms[n - 1] if n <= len(delays_ms) else 0, max_attempts=4)
                assert outcome[0] == ("dead" if n == 4 else "retry")
            else:
                ok.append(d.id)
        c.ack(batch)
        if len(attempts) == 4:
            break
    assert [a for a, _ in attempts] == [1, 2, 3, 4]
    for (_, t0), (_, t1), wanted in zip(attempts, attempts[1:], delays_ms, strict=False):
        assert t1 - t0 >= wanted / 1000 * 0.9, "a retry came back before the delay it asked for"
    assert sorted(ok) == ids("ok", 20), "the failing message held up the rest of its group"
    dead = conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": "orders", "group": "billing"})
    assert [(m["id"], m["attempt"], m["subject"]) for m in dead["messages"]] == [("poison", 4, "orders")]
    assert dead["messages"][0]["reason"] == "test failure"
    stats = conn.request(RequestCode.BROKER_STATS, {})["groups"][0]
    assert stats["dead"] == 1 and stats["retrying"] == 0
    # Re-drive: back to the group through its retry subject, attempt 1; listed no more.
    assert conn.request(RequestCode.BROKER_DEAD_REDRIVE, {"subject": "orders", "group": "billing"}) == {"redriven": 1}
    back = c.drain(1, wait_ms=500)
    assert [(d.id, d.attempt, d.stored_subject) for d in back] == [("poison", 1, "%RETRY%orders%billing")]
    assert conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": "orders", "group": "billing"})["messages"] == []
    other_group = consumer(broker, "orders", "audit", "c", start="earliest")
    assert len(other_group.drain(21, wait_ms=200)) == 21, "another group saw the retry or lost the message"


def test_reject_dead_letters_at_once(broker):
    conn = broker.connect()
    c = consumer(broker, "orders", "billing", "c", start="earliest")
    send(conn, "orders", ["bad"])
    [d] = c.pull(1)
    assert c.nack(d, 0, dead=True, reason="rejected: malformed")[0] == "dead"
    c.ack([d])
    dead = conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": "orders", "group": "billing"})["messages"]
    assert [(m["id"], m["attempt"], m["reason"]) for m in dead] == [("bad", 1, "rejected: malformed")]


def test_long_poll_is_woken_by_a_send(broker):
    conn = broker.connect()
    c = consumer(broker, "orders", "g", "c")
    assert c.pull(1, wait_ms=0) == []
    result: list = []

    def wait() -> None:
        t0 = time.monotonic()
        result.append((c.pull(10, wait_ms=20_000), time.monotonic() - t0))

    t = threading.Thread(target=wait)
    t.start()
    wait_for_waiting_pulls(conn, "orders", 1)
    # The pull is parked on the broker; a send to another subject must not wake it with nothing.
    send(conn, "other", ["x"])
    send(conn, "orders", ["wake"])
    t.join()
    got, elapsed = result[0]
    assert [d.id for d in got] == ["wake"]
    assert elapsed < 10, "the pull waited for its timeout instead of being woken"


def test_waiting_pulls_take_in_the_order_they_came(broker):
    """Pulls waiting on a subject are woken first come, first served: one message at a time goes
    to the consumer that has waited longest, whoever pulls more often."""
    conn = broker.connect()
    names = [f"c{i}" for i in range(6)]
    consumers = [consumer(broker, "fair", "g", name) for name in names]
    for c in consumers:  # join the group before anything is sent
        assert c.pull(1, wait_ms=0) == []
    done: list[tuple[str, list[str]]] = []
    finished = threading.Condition()

    def wait(c: RawConsumer) -> None:
        got = [d.id for d in c.pull(1, wait_ms=30_000)]
        with finished:
            done.append((c.consumer, got))
            finished.notify_all()

    threads = []
    for i, c in enumerate(consumers):
        threads.append(threading.Thread(target=wait, args=(c,)))
        threads[-1].start()
        wait_for_waiting_pulls(conn, "fair", i + 1)
    for n in range(len(names)):
        send(conn, "fair", [f"m{n}"])
        with finished:
            assert finished.wait_for(lambda n=n: len(done) == n + 1, timeout=20)
    for t in threads:
        t.join()
    assert done == [(name, [f"m{n}"]) for n, name in enumerate(names)]
    assert conn.request(RequestCode.BROKER_STATS, {})["pulls_waiting"] == {}


def wait_for_waiting_pulls(conn, subject: str, count: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while conn.request(RequestCode.BROKER_STATS, {})["pulls_waiting"].get(subject, 0) != count:
        assert time.monotonic() < deadline, f"never {count} pulls waiting on {subject}"


def test_unknown_consumer_ack_closes_the_connection(broker):
    conn = broker.connect()
    with pytest.raises(RemoteError) as err:
        conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "nobody", "c", 3]]})
    assert "never pulled" in err.value.message


def test_positions_and_retries_survive_sigkill(processes, broker):
    conn = broker.connect()
    c = consumer(broker, "orders", "g", "c", start="earliest")
    send(conn, "orders", ids("m", 100))
    first = c.pull(60)
    c.ack(first[:40])
    retried = first[40]
    assert c.nack(retried, 1500)[0] == "retry"
    processes.kill(broker.proc)
    broker = restart_broker(processes, broker)
    c = consumer(broker, "orders", "g", "c")  # a fresh process: no memory of pull sequences
    # The retry may fire while the broker restarts: its copy (from the retry subject) may then come
    # first, beside the resent pulls; the order of the plain subject's messages is what is checked.
    resent = c.pull(64)
    plain = [d.id for d in resent if d.stored_subject == "orders"]
    assert plain == [d.id for d in first[40:]], "unacked messages must come back, acked ones not"
    c.ack(resent)
    rest = c.drain(41, wait_ms=2500, empty_pulls=3)
    retry_copies = [d for d in resent + rest if d.stored_subject != "orders"]
    assert [(d.id, d.attempt) for d in retry_copies] == [(retried.id, 2)], "the nacked message is retried once"
    assert Counter(d.id for d in rest if d.stored_subject == "orders") == Counter(ids("m", 100)[60:])


def test_broker_sigkill_during_produce_and_consume(processes, tmp_path):
    """Producer and consumer threads run while the broker (sync flush) is SIGKILLed twice and
    restarted: every acknowledged send is consumed at least once, and nothing is delivered again after
    its ack was confirmed (duplicates only for messages unacked at the crash)."""
    broker = start_broker(processes, tmp_path / "b", "--flush", "sync")
    acknowledged: list[str] = []
    consumed: list[str] = []
    acked: set[str] = set()
    redelivered_after_ack: list[str] = []
    stop = threading.Event()
    up = threading.Event()  # cleared while the broker is down
    up.set()
    progress = threading.Condition()

    def produce() -> None:
        n = 0
        while not stop.is_set():
            try:
                conn = broker.connect(client_id="producer")
                while not stop.is_set():
                    batch = ids(f"p{n}", 50)
                    n += 1
                    if send(conn, "orders", batch)["stored"] == 50:
                        with progress:
                            acknowledged.extend(batch)
                            progress.notify_all()
            except (ConnectionError, OSError, RemoteError, TimeoutError):
                up.wait()

    def consume() -> None:
        while True:
            try:
                c = consumer(broker, "orders", "g", "c", start="earliest")
                while True:
                    batch = c.pull(100, wait_ms=300)
                    if not batch and stop.is_set() and set(consumed) >= set(acknowledged):
                        return
                    redelivered_after_ack.extend(d.id for d in batch if d.id in acked)
                    consumed.extend(d.id for d in batch)
                    c.ack(batch)
                    acked.update(d.id for d in batch)
                    with progress:
                        progress.notify_all()
            except (ConnectionError, OSError, RemoteError, TimeoutError):
                up.wait()

    def wait_for(count: int) -> None:
        with progress:
            assert progress.wait_for(lambda: len(acknowledged) >= count and len(consumed) >= count // 2, 120)

    threads = [threading.Thread(target=produce), threading.Thread(target=consume)]
    for t in threads:
        t.start()
    for round_ in range(2):
        wait_for(3000 * (round_ + 1))
        up.clear()
        processes.kill(broker.proc)
        broker.proc = restart_broker(processes, broker).proc
        up.set()
    wait_for(len(acknowledged) + 2000)
    stop.set()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    missing = set(acknowledged) - set(consumed)
    assert not missing, f"{len(missing)} acknowledged messages never consumed, e.g. {sorted(missing)[:5]}"
    assert not redelivered_after_ack, f"delivered again after a confirmed ack: {redelivered_after_ack[:5]}"


def test_second_broker_on_a_locked_data_dir_exits_with_a_clear_error(processes, tmp_path):
    first = start_broker(processes, tmp_path / "b")
    second = processes.start(
        ["-m", "qmq", "broker", "--data-dir", str(first.data_dir), "--port", "0"],
        name="second",
        env={"PYTHONPATH": str(ROOT)},
    )
    assert second.wait(timeout=30) != 0
    assert "in use by another process" in Path(second.log_path).read_text()
