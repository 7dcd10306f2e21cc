"""Ordered messages without I/O (docs/ordering.md): the queue of a key, the even share of queues,
the broker's queue leases and hand-over, their journal entries and snapshots, the worker's key gate,
and a send that keeps a queue's messages in one request per round."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time

import pytest

from qmq.broker import journal
from qmq.broker.consumer_group import ConsumerGroup, Pull, Release, Reset
from qmq.broker.journal import GroupAction
from qmq.broker.queue_lease import Leased, QueueLeases, handover
from qmq.broker.state import BrokerState
from qmq.client.deliveries import Delivery
from qmq.client.errors import InvalidMessage
from qmq.client.messages import OutgoingMessage
from qmq.client.ordering import share
from qmq.client.routes import Route, RouteGroup, static_route
from qmq.client.sending import SendJob
from qmq.protocol.limits import validate_subject
from qmq.protocol.ordering import ORDER_KEY_HEADER, ORDERED_QUEUES, base_subject, queue_of, split_queue_subject
from worker.key_gate import KeyGate

# -- keys and queues ----------------------------------------------------------------------------------------


def test_a_key_has_the_same_queue_in_every_process() -> None:
    script = "from qmq.protocol.ordering import queue_of; print([queue_of(f'order-{i}') for i in range(50)])"
    runs = {
        subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    assert len(runs) == 1  # not Python's hash(), which changes between processes
    assert runs.pop().strip() == str([queue_of(f"order-{i}") for i in range(50)])
    assert len({queue_of(f"order-{i}") for i in range(1000)}) == ORDERED_QUEUES


def test_queue_subjects() -> None:
    assert split_queue_subject("orders#7") == ("orders", 7)
    assert split_queue_subject("orders") is None
    assert split_queue_subject(f"orders#{ORDERED_QUEUES}") is None
    assert base_subject("orders#63") == "orders" and base_subject("orders") == "orders"
    assert validate_subject("orders#63") == "orders#63"
    with pytest.raises(Exception, match="may only contain"):
        validate_subject("orders#64")


def test_an_ordered_message_goes_to_its_queue_with_its_key() -> None:
    message = OutgoingMessage("orders", {"n": 1}, order_key="order-42")
    wire = message.to_wire()
    assert wire["subject"] == f"orders#{queue_of('order-42')}"
    with pytest.raises(ValueError, match="cannot be delayed"):
        OutgoingMessage("orders", b"x", order_key="k", deliver_at=10**13)
    with pytest.raises(ValueError, match="order_key"):
        OutgoingMessage("orders", b"x", order_key="")
    with pytest.raises(InvalidMessage):
        OutgoingMessage("orders#3", b"x", order_key="k").to_wire()  # a queue's subject is not a subject


def test_a_send_keeps_one_request_per_queue_in_flight() -> None:
    messages = [OutgoingMessage("orders", {"n": n}, order_key="k") for n in range(10)]
    job = SendJob(messages, batch_size=4)
    queue = job.route_subject(0)
    routes = {queue: Route(queue, (RouteGroup("g1", ("a:1",)),))}
    rounds = []
    while not job.done:
        batches = job.plan(routes)
        assert len(batches) == 1  # never two requests of one queue at once: they could be stored in either order
        rounds.append([messages[i].body["n"] for i in batches[0].indices])
        job.on_reply(batches[0], {"rejected": []})
    assert rounds == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_an_ordered_queue_needs_a_broker_route_even_beside_delayed_messages() -> None:
    """The send loop asks for a subject's route as "delayed only" (a delay server suffices, with no
    meta server asked) only when every pending message routed by it is delayed. A queue's subject
    (`subject#queue`) carries ordered messages, which are never delayed: asked as delayed only, a
    client given delay servers directly got a route with no broker group, and its ordered message
    failed."""
    later = int(time.time() * 1000) + 60_000
    job = SendJob(
        [
            OutgoingMessage("orders", b"x", order_key="k"),
            OutgoingMessage("orders", b"y", deliver_at=later),
            OutgoingMessage("later", b"z", deliver_at=later),
            OutgoingMessage("later", b"now"),
        ]
    )
    queue = job.route_subject(0)
    assert job.pending_routes() == {queue: False, "orders": True, "later": False}


def test_a_static_route_puts_a_queue_on_one_broker() -> None:
    brokers = ["a:1", "b:2", "c:3"]
    assert [g.name for g in static_route("orders#4", brokers).groups] == ["b:2"]
    assert len(static_route("orders", brokers).groups) == 3


# -- the even share -----------------------------------------------------------------------------------------


def test_the_share_is_even_contiguous_and_agreed() -> None:
    members = ["w3", "w1", "w2"]
    shares = [share(members, m) for m in sorted(members)]
    assert shares[0] == list(range(0, 22)) and shares[1] == list(range(22, 43)) and shares[2] == list(range(43, 64))
    assert sorted(q for s in shares for q in s) == list(range(ORDERED_QUEUES))
    assert share([], "alone") == list(range(ORDERED_QUEUES))
    assert share(["w1"], "w2") == list(range(32, 64))  # a newcomer counts itself


# -- leases and hand-over at the broker ------------------------------------------------------------------


def test_a_lease_expires_and_a_replay_gives_it_back_whole() -> None:
    leases = QueueLeases(lease_s=20)
    leases.apply(Leased("orders#1", "g", "w1"), now=100)
    assert leases.holder("orders#1", "g", 119.9) == "w1"
    assert leases.holder("orders#1", "g", 120.0) is None  # expired: another may take it
    leases.renew("orders#1", "g", 110)
    assert leases.held_by("orders#1", "g", "w1", 129)
    restarted = QueueLeases(lease_s=20)
    restarted.load(leases.to_state(), now=500)
    assert restarted.holder("orders#1", "g", 519) == "w1"
    leases.apply(Leased("orders#1", "g", ""), now=130)
    assert leases.last_holder("orders#1", "g") is None


def test_members_are_those_that_asked_within_a_lease() -> None:
    leases = QueueLeases(lease_s=5)
    leases.seen("orders", "g", "w2", 0)
    leases.seen("orders", "g", "w1", 3)
    assert leases.members("orders", "g", 4) == ["w1", "w2"]
    assert leases.members("orders", "g", 6) == ["w1"]
    leases.left("orders", "g", "w1")
    assert leases.members("orders", "g", 6) == []


def test_a_new_holder_starts_at_the_oldest_unacknowledged_message() -> None:
    group = ConsumerGroup("orders#1", "g")
    group.apply(Pull("w1", 0, (0, 1, 2, 3, 4), 5))
    group.ack("w1", 1, now=0)  # w1 finished 0 and 1, holds 2-4 unacknowledged
    actions = handover([group])
    assert actions == [(group, Release("w1", 4)), (group, Reset(2))]
    for _, action in actions:
        group.apply(action)
    assert group.cursor == 2 and group.consumers["w1"].pull_log.unacked == 0
    delivery, _ = group.pull("w2", -1, 10, lambda cursor, count: (list(range(cursor, 5)), 5), now=1)
    assert delivery.seqs == [2, 3, 4]  # in order, before anything newer
    assert handover([ConsumerGroup("orders#2", "g")]) == []


def test_leases_and_hand_overs_are_journalled_and_replayed() -> None:
    entries = [
        Leased("orders#1", "g", "w1"),
        GroupAction("orders#1", "g", Release("w0", 3)),
        Leased("orders#1", "g", ""),
    ]
    assert journal.decode(journal.encode(entries)) == entries
    state = BrokerState()
    state.apply(Leased("orders#5", "g", "w1"), now=0)
    again = BrokerState.from_snapshot(state.to_snapshot(), now=10)
    assert again.leases.holder("orders#5", "g", 10 + again.leases.lease_s - 1) == "w1"


# -- the worker's key gate ----------------------------------------------------------------------------------


def delivery(key: str, n: int, subject: str = "orders#1", stored: str | None = None) -> Delivery:
    return Delivery(
        id=f"{key}-{n}",
        subject=subject,
        body=n,
        content_type="application/json",
        headers={ORDER_KEY_HEADER: key},
        tags=(),
        key=None,
        attempt=1,
        created_at=None,
        stored_at=None,
        payload=b"",
        broker="b",
        broker_group="b",
        stored_subject=stored or subject,
        group_key="g",
        consumer="w1",
        pull_seq=n,
        epoch=1,
    )


def test_the_gate_lets_one_message_of_a_key_out_at_a_time() -> None:
    gate = KeyGate()
    a1, a2, b1 = delivery("a", 1), delivery("a", 2), delivery("b", 1)
    assert gate.add([a1, a2, b1]) == []
    out = gate.take(lambda q: True)
    assert sorted(d.id for d in out) == ["a-1", "b-1"]  # keys in parallel, a-2 waits behind a-1
    assert gate.take(lambda q: True) == []
    gate.done(a1)
    assert gate.take(lambda q: True) == [a2]
    assert gate.take(lambda q: False) == []


def test_a_stopped_key_parks_its_messages_until_a_redriven_one_comes() -> None:
    gate = KeyGate()
    a1, a2, a3 = delivery("a", 1), delivery("a", 2), delivery("a", 3)
    gate.add([a1, a2])
    [first] = gate.take(lambda q: True)
    assert gate.stop(first) == [a2]
    assert gate.add([a3]) == [a3]  # parked behind the poison message
    redriven = delivery("a", 1, stored="%RETRY%orders#1%g")
    assert gate.add([redriven]) == []
    assert gate.take(lambda q: True) == [redriven]


def test_a_queue_handed_out_again_drops_what_waits_and_keeps_what_runs() -> None:
    gate = KeyGate()
    a1, a2, c1 = delivery("a", 1), delivery("a", 2), delivery("c", 1, subject="orders#2")
    gate.add([a1, a2, c1])
    gate.take(lambda q: q == 1)
    assert gate.drop_queue(1) == [a2]
    assert gate.busy_queues() == {1, 2}
    gate.put_back(dataclasses.replace(a1))
    assert sorted(d.id for d in gate.take(lambda q: True)) == ["a-1", "c-1"]


def test_pull_sequences_the_broker_gave_to_another_consumer_do_not_hold_back_acks() -> None:
    from qmq.client.deliveries import AckTracker

    tracker = AckTracker(("b", "orders#1", "g", "w1"), epoch=1)
    assert tracker.receive(0, 4) == [0, 1, 2, 3]
    for seq in (0, 1, 2):
        tracker.done(seq)
    assert tracker.take_ack() == 2
    # Pull 4's reply never came; the queue went to another worker and back: the broker released
    # pulls 3 and 4 and answers from 5 though this consumer named 3 as received.
    assert tracker.receive(5, 1) == [5]
    tracker.done(3)  # the delivery of 3 was dropped here (its queue was handed out again)
    tracker.done(5)
    assert tracker.take_ack() == 5
    assert tracker.pulled == 5 and tracker.outstanding == 0


def test_qmq_send_refuses_an_ordered_delayed_message() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "qmq",
            "send",
            "orders",
            "x",
            "--order-key",
            "k",
            "--delay",
            "5",
            "--broker",
            "127.0.0.1:1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2 and "--order-key cannot be combined with --delay" in result.stderr
