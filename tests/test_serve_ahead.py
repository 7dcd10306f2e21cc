"""Serving ahead (qmq/broker/ahead.py), on a real `qmq broker`: a message stored while a prefetching
consumer is between two pulls is recorded for it at once, journalled with the send, and its next
pull hands it out; another consumer of the group does not get it; the record survives a SIGKILL; a
consumer that leaves gives it back with its attempt unchanged; a pull that did not ask, or came
longer ago than the window, is served nothing ahead."""

from __future__ import annotations

import signal
import time

import pytest

from qmq.client import Client
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.broker import Broker, RawConsumer, restart_broker, send, start_broker
from tests.support.replication import wait_for

CONSUMER_TIMEOUT_S = 600  # the sweep never gives anything back during these tests
WINDOW_S = 60.0  # --serve-ahead: each test's steps come well within it, however slow the machine
SHORT_WINDOW_S = 0.3
RETRY_SUBJECT = "%RETRY%orders%billing"


@pytest.fixture
def broker(processes, tmp_path) -> Broker:
    return start_broker(
        processes,
        tmp_path / "broker",
        "--consumer-timeout",
        str(CONSUMER_TIMEOUT_S),
        "--serve-ahead",
        str(WINDOW_S),
    )


def consumer(broker: Broker, name: str, **options) -> RawConsumer:
    return RawConsumer(broker.connect(client_id=name), "orders", "billing", name, {"start": "earliest", **options})


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(n)]


def test_a_message_stored_between_pulls_waits_for_the_prefetching_consumer(broker):
    ahead, other = consumer(broker, "ahead", ahead=5), consumer(broker, "other")
    assert ahead.pull(wait_ms=0) == [] and other.pull(wait_ms=0) == []  # both known; "ahead" is now away
    with broker.connect() as conn:
        send(conn, "orders", ids("m", 3))
    assert other.pull(wait_ms=0) == []  # stored for "ahead" with the send, before anyone asked
    served = ahead.pull(wait_ms=0)
    assert [(d.id, d.attempt, d.pull_seq) for d in served] == [(i, 1, n) for n, i in enumerate(ids("m", 3))]
    ahead.ack(served)
    with broker.connect() as conn:  # up to `ahead` in one absence: the rest is anyone's
        send(conn, "orders", ids("n", 8))
    assert [d.id for d in other.pull(wait_ms=0)] == ids("n", 8)[5:]
    assert [d.id for d in ahead.pull(wait_ms=0)] == ids("n", 8)[:5]


def test_what_was_served_ahead_survives_a_kill(processes, broker):
    ahead, other = consumer(broker, "ahead", ahead=5), consumer(broker, "other")
    assert ahead.pull(wait_ms=0) == [] and other.pull(wait_ms=0) == []
    with broker.connect() as conn:
        send(conn, "orders", ids("k", 2))
    broker.proc.send_signal(signal.SIGKILL)
    broker.proc.wait(30)
    restarted = restart_broker(processes, broker)
    other = consumer(restarted, "other")
    assert other.pull(wait_ms=0) == []  # the journal still says "ahead" holds them
    assert [(d.id, d.attempt) for d in consumer(restarted, "ahead").pull(wait_ms=0)] == [("k-000", 1), ("k-001", 1)]


def test_a_consumer_that_leaves_gives_back_what_it_was_served_ahead(broker):
    ahead, other = consumer(broker, "ahead", ahead=5), consumer(broker, "other")
    assert ahead.pull(wait_ms=0) == [] and other.pull(wait_ms=0) == []
    with broker.connect() as conn:
        send(conn, "orders", ids("l", 2))
        assert other.pull(wait_ms=0) == []
        assert conn.request(RequestCode.BROKER_LEAVE, {"leaves": [["orders", "billing", "ahead", -1]]}) == {
            "released": 2
        }
        assert [(d.id, d.attempt) for d in other.drain(2, wait_ms=2000)] == [("l-000", 1), ("l-001", 1)]
        send(conn, "orders", ["after"])  # gone: served nothing more
    assert [d.id for d in other.pull(wait_ms=0)] == ["after"]


def held(broker: Broker, stored: str, consumer: str) -> int:
    """Messages `consumer` of group billing holds on `stored` (BROKER_CONSUMERS)."""
    with broker.connect() as conn:
        listing = conn.request(RequestCode.BROKER_CONSUMERS, {})["consumers"]
    return sum(
        c["in_flight"] for c in listing if (c["subject"], c["group"], c["consumer"]) == (stored, "billing", consumer)
    )


def test_a_leave_gives_back_what_was_served_ahead_on_a_subject_it_did_not_name(broker):
    """A client's leave names the stored subjects it received from; a retry served ahead to it on its
    group's retry subject, which it never received from, goes back too, keeping its attempt."""
    other = consumer(broker, "other")
    assert other.pull(wait_ms=0) == []
    with broker.connect() as conn:
        send(conn, "orders", ["x"])
    [taken] = other.pull(wait_ms=0)
    ahead = consumer(broker, "ahead", ahead=5)
    assert ahead.pull(wait_ms=0) == []  # "ahead" is away, with room
    other.nack(taken, 0)  # its retry is due at once: served ahead to "ahead"
    wait_for(lambda: held(broker, RETRY_SUBJECT, "ahead") == 1, "the retry to be served ahead")
    with broker.connect() as conn:
        assert conn.request(RequestCode.BROKER_LEAVE, {"leaves": [["orders", "billing", "ahead", -1]]}) == {
            "released": 1
        }
    assert [(d.id, d.attempt) for d in other.drain(1, wait_ms=2000)] == [("x", 2)]


def test_a_subscription_closed_before_it_received_anything_gives_back_what_it_was_served_ahead(broker):
    """Its pull came back empty, so the broker serves it ahead; it holds no tracker, yet its close
    must tell the broker, or what is stored next waits for it until the consumer timeout."""
    other = consumer(broker, "other")
    assert other.pull(wait_ms=0) == []
    with Client(brokers=[broker.address]) as client:
        subscription = client.subscribe("orders", "billing", consumer="idle", serve_ahead=True)
        assert subscription.pull(max=10, wait_s=0.2) == []
        subscription.close()
    with broker.connect() as conn:
        send(conn, "orders", ids("m", 3))
    assert [(d.id, d.attempt) for d in other.drain(3, wait_ms=2000)] == [(i, 1) for i in ids("m", 3)]


def test_only_a_pull_that_asks_is_served_ahead(broker):
    plain, other = consumer(broker, "plain"), consumer(broker, "other")
    assert plain.pull(wait_ms=0) == [] and other.pull(wait_ms=0) == []
    with broker.connect() as conn:
        send(conn, "orders", ["p-000"])
    assert [d.id for d in other.pull(wait_ms=0)] == ["p-000"]
    for bad in (-1, 5000, "5"):
        with pytest.raises(RemoteError) as refused:
            consumer(broker, "bad", ahead=bad).pull(wait_ms=0)
        assert refused.value.code == ErrorCode.BAD_REQUEST


def test_a_consumer_away_longer_than_the_window_is_served_nothing_ahead(processes, tmp_path):
    broker = start_broker(processes, tmp_path / "short", "--serve-ahead", str(SHORT_WINDOW_S))
    ahead, other = consumer(broker, "ahead", ahead=5), consumer(broker, "other")
    assert ahead.pull(wait_ms=0) == [] and other.pull(wait_ms=0) == []
    time.sleep(SHORT_WINDOW_S * 2)  # the window running out is what is tested
    with broker.connect() as conn:
        send(conn, "orders", ["late"])
    assert [d.id for d in other.pull(wait_ms=0)] == ["late"]


def test_served_ahead_no_more_than_the_room_the_pull_left(broker):
    ahead, other = consumer(broker, "ahead", ahead=64), consumer(broker, "other")
    assert ahead.pull(max_count=3, wait_ms=0) == [] and other.pull(wait_ms=0) == []  # room for 3
    with broker.connect() as conn:
        send(conn, "orders", ids("a", 2))  # both served ahead: room for 1 more in the same absence
        send(conn, "orders", ids("b", 2))
    assert [d.id for d in other.pull(wait_ms=0)] == ["b-001"]
    assert [d.id for d in ahead.pull(max_count=3, wait_ms=0)] == ["a-000", "a-001", "b-000"]
    with broker.connect() as conn:  # that pull took all it asked for: no room, nothing served ahead
        send(conn, "orders", ids("c", 2))
    assert [d.id for d in other.pull(wait_ms=0)] == ids("c", 2)
