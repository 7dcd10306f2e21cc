"""The client's I/O-free core: ack prefixes with out-of-order completion and resends, pull replies to
deliveries, dropped trackers, merging send replies, choosing and retrying groups, routes; and its
loops (route look-up, send, cancel, pull round, ack flush, nack) driven by hand, each step answered
by the test: no socket, no thread, no event loop."""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Generator
from concurrent.futures import Future
from datetime import UTC, datetime
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.client.consuming import (
    ACK_TIMEOUT_S,
    PULL_RETRY_MAX_DELAY_S,
    SubscriptionCore,
    pull_retry_delay_s,
    update_slots,
)
from qmq.client.core import ClientCore
from qmq.client.deliveries import PULL_REPLY_GRACE_S, AckTracker, Delivery, SubscribeOptions, SubscriptionState
from qmq.client.errors import ClientClosed, ClientError, ConnectFailed, InvalidMessage, MetaUnreachable
from qmq.client.messages import OutgoingMessage, SendError, check_message
from qmq.client.routes import META_TIMEOUT_S, RouteBook, RouteCache, parse_address, parse_route, static_route
from qmq.client.sending import RETRY_DELAY_S, RETRY_MAX_DELAY_S, GroupHealth, SendJob, choose_group
from qmq.client.steps import Call, Calls, GetRoute, Sleep, Start, WaitAll, WaitAny
from qmq.protocol import envelope
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError

KEY = ("127.0.0.1:1", "s", "g", "c")

# ---- AckTracker -----------------------------------------------------------------------------------


def test_ack_tracker_releases_only_the_contiguous_done_prefix() -> None:
    tracker = AckTracker(KEY, epoch=1)
    assert tracker.pulled is None and tracker.take_ack() is None
    assert tracker.receive(0, 5) == [0, 1, 2, 3, 4]
    assert tracker.pulled == 4 and tracker.outstanding == 5
    tracker.done(2)
    tracker.done(1)
    assert tracker.take_ack() is None  # 0 is not done: nothing may be acked yet
    tracker.done(0)
    assert tracker.take_ack() == 2
    assert tracker.take_ack() is None  # nothing new since
    tracker.done(4)
    assert tracker.take_ack() is None
    tracker.done(3)
    assert tracker.take_ack() == 4
    assert tracker.outstanding == 0


def test_ack_tracker_starts_at_the_first_batch_it_sees() -> None:
    tracker = AckTracker(KEY, epoch=1)
    assert tracker.receive(40, 2) == [40, 41]
    tracker.done(41)
    tracker.done(40)
    assert tracker.take_ack() == 41


def test_ack_tracker_resent_batch_repeats_known_sequences() -> None:
    tracker = AckTracker(KEY, epoch=1)
    tracker.receive(0, 3)
    tracker.done(0)
    assert tracker.take_ack() == 0
    # The broker resends 1..4 (it never saw 3 and 4 arrive); 1 and 2 are already here.
    assert tracker.receive(1, 4) == [3, 4]
    assert tracker.receive(0, 1) == []  # acked already
    tracker.done(1)
    tracker.done(1)  # twice is once
    tracker.done(2)
    assert tracker.take_ack() == 2


def test_ack_tracker_lost_reply_is_resent_and_a_released_gap_is_skipped() -> None:
    tracker = AckTracker(KEY, epoch=1)
    tracker.receive(0, 2)
    for seq in (0, 1):
        tracker.done(seq)
    assert tracker.take_ack() == 1
    # The reply carrying 2..4 was lost: the next pull names pulled=1 and the broker resends from 2.
    assert tracker.receive(2, 5) == [2, 3, 4, 5, 6]
    assert tracker.pulled == 6
    for seq in (2, 3, 4, 5, 6):
        tracker.done(seq)
    assert tracker.take_ack() == 6
    # A broker answers past what the consumer named only when what lies between is acknowledged
    # there (released to another consumer): the gap does not hold the acknowledgements back.
    assert tracker.receive(10, 2) == [10, 11]
    assert tracker.pulled == 11
    tracker.done(10)
    tracker.done(11)
    assert tracker.take_ack() == 11


def test_ack_tracker_ignores_done_for_sequences_never_received() -> None:
    tracker = AckTracker(KEY, epoch=1)
    tracker.done(0)  # nothing received yet
    tracker.receive(3, 2)
    tracker.done(2)  # below the first batch
    tracker.done(9)  # above anything received
    assert tracker.take_ack() is None
    tracker.done(3)
    assert tracker.take_ack() == 3


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 60), st.integers(0, 2**32), st.integers(1, 8))
def test_ack_tracker_never_acks_past_an_unfinished_sequence(count: int, seed: int, batch: int) -> None:
    """Whatever the order of completions and however the batches repeat, every ack is a prefix of
    finished sequences, acks only grow, and the last one covers everything."""
    rng = random.Random(seed)
    tracker = AckTracker(KEY, epoch=1)
    first = rng.randrange(0, 100)
    for start in range(first, first + count, batch):  # batches, some of them twice (resends)
        n = min(batch, first + count - start)
        tracker.receive(start, n)
        if rng.random() < 0.3:
            tracker.receive(max(first, start - rng.randrange(0, batch)), n)
    order = list(range(first, first + count))
    rng.shuffle(order)
    finished: set[int] = set()
    last_ack = first - 1
    for seq in order:
        tracker.done(seq)
        finished.add(seq)
        ack = tracker.take_ack()
        if ack is not None:
            assert ack > last_ack
            assert all(s in finished for s in range(first, ack + 1))
            last_ack = ack
    assert last_ack == first + count - 1
    assert tracker.outstanding == 0


# ---- SubscriptionState ----------------------------------------------------------------------------

A = "127.0.0.1:20881"
B = "127.0.0.1:20882"


def message(mid: str, body=b"x", *, attempt: int = 1, subject: str = "order.created", **extra) -> dict:
    payload = envelope.encode(body, headers={"h": "1"}, created_at=1_700_000_000_000)
    return {
        "id": mid,
        "subject": subject,
        "payload": payload,
        "key": extra.get("key"),
        "tags": extra.get("tags", []),
        "attempt": attempt,
        "stored_at": 1_700_000_000_500,
    }


def batch(stored: str, first: int, ids: list[str], *, resent: bool = False, group: str = "billing") -> dict:
    return {
        "subject": stored,
        "group": group,
        "first_pull": first,
        "resent": resent,
        "messages": [message(i) for i in ids],
    }


@pytest.fixture
def state() -> SubscriptionState:
    return SubscriptionState(SubscribeOptions("order.created", "billing", "c1", tags=("new",)))


def test_pull_request_names_what_was_received(state: SubscriptionState) -> None:
    body = state.pull_request(A, 64, 2.5)
    assert body == {
        "subject": "order.created",
        "group": "billing",
        "consumer": "c1",
        "max": 64,
        "wait_ms": 2500,
        "tags": ["new"],
        "match_all": False,
        "broadcast": False,
        "start": "latest",
        "pulled": {},
    }
    retry = "%RETRY%order.created%billing"
    state.accept(A, {"batches": [batch(retry, 0, ["r1"]), batch("order.created", 7, ["m1", "m2"])]})
    assert state.pull_request(A, 10, 0)["pulled"] == {retry: 0, "order.created": 8}
    assert state.pull_request(B, 10, 0)["pulled"] == {}  # another broker's sequences are its own
    assert state.pull_request(A, 10_000, 99)["max"] == 4096
    assert state.pull_request(A, 10, 99)["wait_ms"] == 30_000


def test_a_pull_that_waits_asks_to_be_served_ahead_when_told_to() -> None:
    def asks(**options) -> list[int | None]:
        state = SubscriptionState(SubscribeOptions("order.created", "billing", "c1", **options))
        return [state.pull_request(A, 16, wait_s).get("ahead") for wait_s in (1.0, 0)]

    assert asks() == [None, None]
    assert asks(serve_ahead=True) == [16, None]  # not the registration pull, which waits for nothing
    assert asks(prefetch=True) == [16, None]
    assert asks(serve_ahead=True, broadcast=True) == [None, None]  # nobody else would take them
    assert asks(serve_ahead=True, ordered=True) == [None, None]  # a queue's holder has them anyway


def test_leave_requests_name_what_the_application_was_handed(state: SubscriptionState) -> None:
    retry = "%RETRY%order.created%billing"
    state.accept(A, {"batches": [batch(retry, 0, ["r1"]), batch("order.created", 7, ["m1", "m2", "m3"])]})
    state.accept(B, {"batches": [batch("order.created", 0, ["n1"])]})
    not_handed = [((A, "order.created", "billing", "c1"), 9), ((A, "order.created", "billing", "c1"), 8)]
    assert state.leave_requests(not_handed) == {
        A: {"leaves": [[retry, "billing", "c1", 0], ["order.created", "billing", "c1", 7]]},
        B: {"leaves": [["order.created", "billing", "c1", 0]]},
    }
    assert state.leave_requests([])[A]["leaves"][1] == ["order.created", "billing", "c1", 9]  # all handed


def test_accept_decodes_deliveries(state: SubscriptionState) -> None:
    reply = {
        "batches": [
            {
                "subject": "order.created",
                "group": "billing",
                "first_pull": 3,
                "resent": False,
                "messages": [message("m1", {"id": 7}, key="7", tags=["new"])],
            }
        ]
    }
    [d] = state.accept(A, reply)
    assert (d.id, d.subject, d.body, d.content_type) == ("m1", "order.created", {"id": 7}, envelope.JSON)
    assert d.headers == {"h": "1"} and d.tags == ("new",) and d.key == "7" and d.attempt == 1
    assert d.created_at == datetime(2023, 11, 14, 22, 13, 20, tzinfo=UTC)
    assert d.stored_at == datetime(2023, 11, 14, 22, 13, 20, 500000, tzinfo=UTC)
    assert (d.broker, d.stored_subject, d.group_key, d.consumer, d.pull_seq) == (A, "order.created", "billing", "c1", 3)
    assert not d.is_retry


def test_foreign_payload_is_bytes(state: SubscriptionState) -> None:
    raw = msgpack.packb({"not": "an envelope"})
    reply = {
        "batches": [
            {
                "subject": "order.created",
                "group": "billing",
                "first_pull": 0,
                "messages": [{"id": "x", "subject": "order.created", "payload": raw, "attempt": 1, "stored_at": 1}],
            }
        ]
    }
    [d] = state.accept(A, reply)
    assert d.body == raw and d.content_type == envelope.BYTES and d.created_at is None


def test_acks_are_prefixes_per_broker_and_stored_subject(state: SubscriptionState) -> None:
    retry = "%RETRY%order.created%billing"
    ds = state.accept(A, {"batches": [batch(retry, 0, ["r1"]), batch("order.created", 0, ["m1", "m2", "m3"])]})
    ds += state.accept(B, {"batches": [batch("order.created", 5, ["n1"])]})
    by_id = {d.id: d for d in ds}
    for mid in ("m3", "m1", "r1", "n1"):
        assert state.done(by_id[mid])
    assert state.take_acks() == {
        A: [[retry, "billing", "c1", 0], ["order.created", "billing", "c1", 0]],
        B: [["order.created", "billing", "c1", 5]],
    }
    assert state.outstanding == 1
    state.done(by_id["m2"])
    assert state.take_acks() == {A: [["order.created", "billing", "c1", 2]]}
    assert state.take_acks() == {}


def test_resent_batch_hands_out_only_what_is_new(state: SubscriptionState) -> None:
    first = state.accept(A, {"batches": [batch("order.created", 0, ["m1", "m2"])]})
    again = state.accept(A, {"batches": [batch("order.created", 0, ["m1", "m2", "m3"], resent=True)]})
    assert [d.id for d in first] == ["m1", "m2"]
    assert [d.id for d in again] == ["m3"]


def test_dropped_tracker_makes_its_deliveries_stale_and_is_resent_from_scratch(state: SubscriptionState) -> None:
    [d1, d2] = state.accept(A, {"batches": [batch("order.created", 0, ["m1", "m2"])]})
    state.done(d1)
    acks = state.take_acks()
    assert state.drop(A, acks[A]) == 1  # the ack failed: forget, the broker resends
    assert not state.is_current(d2) and not state.done(d2)
    assert state.pull_request(A, 10, 0)["pulled"] == {}  # so the broker starts at its ack point
    [r1, r2] = state.accept(A, {"batches": [batch("order.created", 0, ["m1", "m2"], resent=True)]})
    assert state.is_current(r1) and not state.is_current(d1)
    state.done(r2)
    state.done(d2)  # the stale one changes nothing
    assert state.take_acks() == {}
    state.done(r1)
    assert state.take_acks() == {A: [["order.created", "billing", "c1", 1]]}


def test_reply_to_a_pull_made_before_a_drop_is_ignored(state: SubscriptionState) -> None:
    state.accept(A, {"batches": [batch("order.created", 0, ["m1"])]})
    generation = state.generation(A)
    state.pull_request(A, 10, 1)  # in flight with pulled = {order.created: 0}
    state.drop(A)
    # Its messages follow pull sequence 0, which nobody acknowledged: a tracker starting at 1 would
    # acknowledge 0 with its first ack. The reply is dropped; the next pull gets 0 and 1 again.
    assert state.accept(A, {"batches": [batch("order.created", 1, ["m2"])]}, generation) == []
    assert state.pull_request(A, 10, 1)["pulled"] == {}
    assert [
        d.id
        for d in state.accept(
            A, {"batches": [batch("order.created", 0, ["m1", "m2"], resent=True)]}, state.generation(A)
        )
    ] == ["m1", "m2"]


def test_broker_that_forgot_the_consumer_resets_the_tracker(state: SubscriptionState) -> None:
    [d1, _] = state.accept(A, {"batches": [batch("order.created", 0, ["m1", "m2"])]})
    # New messages numbered from 0 again: the broker lost its pull log for this consumer.
    assert state.accept(A, {"batches": [batch("order.created", 0, ["m9"])]}) == []
    assert not state.is_current(d1)
    assert state.pull_request(A, 10, 0)["pulled"] == {}


def test_nack_and_heartbeat_requests(state: SubscriptionState) -> None:
    retry = "%RETRY%order.created%billing"
    [d] = state.accept(
        A,
        {"batches": [{"subject": retry, "group": "billing", "first_pull": 4, "messages": [message("m1", attempt=2)]}]},
    )
    assert d.is_retry and d.attempt == 2
    assert state.nack_request(d, 1.5, reason="boom") == {
        "nacks": [
            {
                "subject": retry,
                "group": "billing",
                "consumer": "c1",
                "pull_seq": 4,
                "attempt": 2,
                "delay_ms": 1500,
                "dead": False,
                "reason": "boom",
            }
        ]
    }
    assert state.nack_request(d, 0, dead=True, max_attempts=3)["nacks"][0]["max_attempts"] == 3
    with pytest.raises(ValueError):
        state.nack_request(d, -1)
    with pytest.raises(ValueError):
        state.nack_request(d, float("nan"))
    assert state.heartbeat_requests() == {A: {"consumers": [[retry, "billing", "c1"]]}}


def test_subscribe_options_are_checked() -> None:
    assert SubscribeOptions("s", "g").consumer  # a default consumer id that the broker accepts
    with pytest.raises(ValueError, match="group"):
        SubscribeOptions("s", "bad group")
    with pytest.raises(ValueError, match="consumer"):
        SubscribeOptions("s", "g", consumer="a b")
    with pytest.raises(ValueError, match="subject"):
        SubscribeOptions("%RETRY%s%g", "g")
    with pytest.raises(ValueError, match="start"):
        SubscribeOptions("s", "g", start="middle")
    with pytest.raises(ValueError, match="tag"):
        SubscribeOptions("s", "g", tags=("a b",))


def test_pull_retry_delay_backs_off() -> None:
    delays = [pull_retry_delay_s(n) for n in range(1, 10)]
    assert delays[0] == 0  # a lost connection is reopened at once
    assert delays == sorted(delays) and delays[1] == 0.5 and delays[-1] == PULL_RETRY_MAX_DELAY_S == 1.0


# ---- sending --------------------------------------------------------------------------------------

G1 = {"name": "g1", "addresses": ["127.0.0.1:1"], "available": True, "read_only": False}
G2 = {"name": "g2", "addresses": ["127.0.0.1:2"], "available": True, "read_only": False}


def route(*groups: dict, subject: str = "s"):
    return parse_route(subject, {"subject": subject, "groups": list(groups)})


def messages(n: int, subject: str = "s") -> list[OutgoingMessage]:
    return [OutgoingMessage(subject, f"body {i}") for i in range(n)]


def test_to_wire_wraps_the_body_in_the_envelope() -> None:
    message = OutgoingMessage("s", {"a": 1}, key="k", tags=["t"], headers={"h": "v"}, id="id-1", created_at=5)
    wire = message.to_wire()
    assert {k: v for k, v in wire.items() if k != "payload"} == {
        "id": "id-1",
        "subject": "s",
        "key": "k",
        "tags": ["t"],
    }
    assert envelope.decode(wire["payload"]) == ({"a": 1}, envelope.JSON, {"h": "v"}, 5, b'{"a":1}')
    bare = OutgoingMessage("s", b"", key="").to_wire()  # no key, no tags: left out, the broker stores none
    assert sorted(bare) == ["id", "payload", "subject"]
    with pytest.raises(InvalidMessage) as info:
        OutgoingMessage("%DEAD%s%g", b"").to_wire()
    assert info.value.code == ErrorCode.BAD_SUBJECT
    with pytest.raises(InvalidMessage):
        OutgoingMessage("s", b"", tags=["a b"]).to_wire()
    with pytest.raises(InvalidMessage):
        OutgoingMessage("s", b"", key="k" * 300).to_wire()
    with pytest.raises(TypeError):
        OutgoingMessage("s", object()).to_wire()


def test_a_checked_message_is_sent_as_checked_not_encoded_again() -> None:
    """An outbox checks its message when it is written (`check_message`); the after-commit send then
    uses that wire form (the same payload bytes) and may add to its copy without changing it."""
    later = int(time.time() * 1000) + 60_000
    message = OutgoingMessage("s", {"order": 1}, key="k", deliver_at=later)
    checked = check_message(message)
    first, second = SendJob([message]), SendJob([message])
    assert first.wires[0]["payload"] is checked["payload"]
    assert first.wires[0]["deliver_at"] == later and "deliver_at" not in check_message(message)
    assert second.wires[0] == first.wires[0] and second.wires[0] is not first.wires[0]
    fresh = OutgoingMessage("s", {"order": 1}, key="k", id=message.id, created_at=message.created_at).to_wire()
    assert fresh == checked


def test_send_job_merges_stored_and_rejected() -> None:
    job = SendJob(messages(4), batch_size=10)
    [batch_] = job.plan({"s": route(G1)})
    assert batch_.group == "g1" and batch_.indices == [0, 1, 2, 3]
    assert [m["id"] for m in batch_.body["messages"]] == [m.id for m in job.messages]
    job.on_reply(
        batch_,
        {"stored": 2, "rejected": [[1, ErrorCode.MESSAGE_TOO_LARGE, "too big"], [3, ErrorCode.BAD_REQUEST, "bad tag"]]},
    )
    assert job.done
    results = job.results()
    assert [r.ok for r in results] == [True, False, True, False]
    assert results[0].group == "g1" and results[0].message_id == job.messages[0].id
    assert results[1].error_code == ErrorCode.MESSAGE_TOO_LARGE and "too big" in results[1].error
    assert results[3].error.startswith("BAD_REQUEST")


def test_a_send_names_the_epoch_the_meta_server_gave_its_group() -> None:
    """A replicated group's batch carries its epoch, so a deposed master refuses it; a group without
    one (not replicated) gets the body as before."""
    job = SendJob(messages(20))
    batches = job.plan({"s": route({**G1, "master": "127.0.0.1:1", "epoch": 3}, G2)})
    by_group = {b.group: b.body for b in batches}
    assert by_group["g1"]["epoch"] == 3 and "epoch" not in by_group["g2"]
    assert len(by_group["g1"]["messages"]) + len(by_group["g2"]["messages"]) == 20
    delayed = SendJob([OutgoingMessage("s", "later", deliver_at=int(time.time() * 1000) + 60_000)])
    delay_route = parse_route("s", {"groups": [G1], "delay_servers": [{"address": "127.0.0.1:9", "epoch": 4}]})
    [batch_] = delayed.plan({"s": delay_route})
    assert batch_.code == RequestCode.DELAY_SEND and batch_.body["epoch"] == 4


def test_send_job_reports_invalid_messages_without_sending_them() -> None:
    job = SendJob(
        [OutgoingMessage("s", "ok"), OutgoingMessage("bad subject", "x"), OutgoingMessage("s", "x", tags=["a b"])]
    )
    [batch_] = job.plan({"s": route(G1)})
    assert batch_.indices == [0]
    job.on_reply(batch_, {"stored": 1, "rejected": []})
    codes = [r.error_code for r in job.results()]
    assert codes == [None, ErrorCode.BAD_SUBJECT, ErrorCode.BAD_REQUEST]


def test_send_job_retries_on_another_group_with_the_same_id() -> None:
    job = SendJob(messages(20))
    routes = {"s": route(G1, G2)}
    batches = job.plan(routes)
    assert {b.group for b in batches} == {"g1", "g2"}  # spread over both by message id
    failed = next(b for b in batches if b.group == "g1")
    ok = next(b for b in batches if b.group == "g2")
    job.on_reply(ok, {"stored": len(ok.indices), "rejected": []})
    assert job.on_error(failed, ConnectionError("connection to 127.0.0.1:1 was lost"))
    assert not job.done
    [retry] = job.plan(routes)
    assert retry.group == "g2" and retry.indices == failed.indices
    assert [m["id"] for m in retry.body["messages"]] == [m["id"] for m in failed.body["messages"]]
    assert job.retry_delay_s == 0  # a group not tried yet: no need to wait
    job.on_reply(retry, {"stored": len(retry.indices), "rejected": []})
    results = job.results()
    assert all(r.ok for r in results)
    assert {results[i].group for i in failed.indices} == {"g2"}


@pytest.mark.parametrize(
    "error",
    [
        RemoteError(ErrorCode.READ_ONLY, "read-only"),
        RemoteError(ErrorCode.UNAVAILABLE, "store"),
        RemoteError(ErrorCode.TIMEOUT, "slow"),
        TimeoutError("no reply"),
        ConnectionRefusedError(111, "refused"),
    ],
)
def test_send_job_retriable_errors(error: BaseException) -> None:
    job = SendJob(messages(1))
    [b] = job.plan({"s": route(G1, G2)})
    assert job.on_error(b, error)
    [again] = job.plan({"s": route(G1, G2)})
    assert again.group != b.group


def test_send_job_final_errors_are_not_retried() -> None:
    job = SendJob(messages(2))
    [b] = job.plan({"s": route(G1)})
    assert not job.on_error(b, RemoteError(ErrorCode.UNAUTHORIZED, "wrong token"))
    assert job.done and all(r.error_code == ErrorCode.UNAUTHORIZED for r in job.results())


def test_send_job_rejection_with_a_retriable_code_is_retried() -> None:
    job = SendJob(messages(1))
    routes = {"s": route(G1, G2)}
    [b] = job.plan(routes)
    job.on_reply(b, {"stored": 0, "rejected": [[0, ErrorCode.UNAVAILABLE, "disk full"]]})
    assert not job.done
    [again] = job.plan(routes)
    assert again.group != b.group


def test_send_job_gives_up_after_its_attempts_naming_the_last_error() -> None:
    job = SendJob(messages(1), max_attempts=3)
    routes = {"s": route(G1, G2)}
    groups = []
    for _ in range(3):
        [b] = job.plan(routes)
        groups.append(b.group)
        job.on_error(b, ConnectionError(f"lost {b.group}"))
    assert sorted(groups[:2]) == ["g1", "g2"]
    assert job.retry_delay_s == RETRY_DELAY_S  # the third attempt goes back to a group that failed
    assert job.plan(routes) == [] and job.done
    [result] = job.results()
    assert not result.ok and result.error_code == ErrorCode.UNAVAILABLE
    assert "3 attempts" in result.error and f"lost {groups[-1]}" in result.error


def test_send_job_offers_a_message_again_until_its_delivery_timeout_then_names_it() -> None:
    job = SendJob(messages(1), max_attempts=3, delivery_timeout_s=10.0, started=100.0)
    routes = {"s": route(G1)}
    delays = []
    now = 100.0
    while now < 110.0:
        [b] = job.plan(routes, now=now)
        delays.append(job.retry_delay_s)
        job.on_error(b, ConnectionError("refused"))
        now += 1.5
    assert len(delays) == 7  # past its three attempts: the group may come back (a restart, a failover)
    assert delays[:4] == [0.0, RETRY_DELAY_S, 2 * RETRY_DELAY_S, 4 * RETRY_DELAY_S]
    assert max(delays) == RETRY_MAX_DELAY_S
    [b] = job.plan(routes, now=109.9)  # never sleeps past the timeout
    assert job.retry_delay_s == pytest.approx(0.1)
    job.on_error(b, ConnectionError("refused"))
    assert job.plan(routes, now=110.0) == [] and job.done
    [result] = job.results()
    assert not result.ok and result.error_code == ErrorCode.UNAVAILABLE
    assert result.error.startswith("not stored within 10 s (8 attempts, on g1); last: group g1: refused")


def test_a_closed_client_ends_a_send_job_at_once() -> None:
    job = SendJob(messages(2), delivery_timeout_s=60.0, started=0.0)
    [b] = job.plan({"s": route(G1)}, now=1.0)
    assert not job.on_error(b, ClientClosed())  # not offered again: nothing goes through it any more
    assert [r.error for r in job.results()] == ["this client was closed"] * 2
    waiting = SendJob(messages(1), delivery_timeout_s=60.0, started=0.0)
    waiting.fail_subject("s", ErrorCode.UNAVAILABLE, "this client was closed", 1.0, final=True)
    assert waiting.done and not waiting.waiting
    assert waiting.results()[0].error == "this client was closed"  # not "within 60 s": it did not wait


def test_send_job_without_a_delivery_timeout_stops_at_its_attempts() -> None:
    job = SendJob(messages(1), max_attempts=2, delivery_timeout_s=0.0)
    for _ in range(2):
        [b] = job.plan({"s": route(G1)}, now=5.0)
        job.on_error(b, ConnectionError("refused"))
    assert job.plan({"s": route(G1)}, now=5.0) == [] and not job.results()[0].ok


def test_send_job_waits_for_a_writable_group_until_its_delivery_timeout() -> None:
    down = {**G1, "available": False}
    job = SendJob(messages(2), delivery_timeout_s=5.0, started=0.0)
    assert job.plan({"s": route(down)}, now=0.0) == []
    assert not job.done and job.waiting == {"s"} and job.retry_delay_s == RETRY_DELAY_S
    job.waiting = set()
    assert job.plan({"s": route(down)}, now=0.3) == [] and job.retry_delay_s == 2 * RETRY_DELAY_S
    job.waiting = set()
    [b] = job.plan({"s": route(G1)}, now=0.9)  # a broker joined, a replica took office
    assert len(b.indices) == 2 and not job.waiting
    job.on_reply(b, {"stored": 2, "rejected": []})
    assert all(r.ok for r in job.results())
    static = SendJob(messages(1), delivery_timeout_s=5.0, started=0.0, routes_change=False)  # brokers given
    assert static.plan({"s": route(down)}, now=0.0) == [] and static.done  # no group can appear: no wait
    assert static.results()[0].error == "no writable broker group carries subject 's'"
    late = SendJob(messages(1), delivery_timeout_s=5.0, started=0.0)
    late.fail_subject("s", ErrorCode.UNAVAILABLE, "cannot reach the meta server at m:1", now=1.0)
    assert late.waiting == {"s"} and not late.done
    late.waiting = set()
    late.fail_subject("s", ErrorCode.UNAVAILABLE, "cannot reach the meta server at m:1", now=5.0)
    [result] = late.results()
    assert result.error == "not stored within 5 s; cannot reach the meta server at m:1"


def test_send_job_skips_read_only_and_unavailable_groups() -> None:
    read_only = {**G1, "read_only": True}
    down = {**G2, "available": False}
    job = SendJob(messages(10))
    [b] = job.plan({"s": route(read_only, {**G2, "name": "g3"})})
    assert b.group == "g3"
    job2 = SendJob(messages(1))
    assert job2.plan({"s": route(read_only, down)}) == []
    [result] = job2.results()
    assert result.error_code == ErrorCode.UNAVAILABLE and "no writable broker group" in result.error


def test_send_job_fails_a_subject_without_a_route() -> None:
    job = SendJob(messages(2, "a") + messages(1, "b"))
    assert set(job.pending_routes()) == {"a", "b"}
    job.fail_subject("a", ErrorCode.UNAVAILABLE, "cannot reach the meta server at x:1: refused")
    assert set(job.pending_routes()) == {"b"}
    [b] = job.plan({"b": route(G1, subject="b")})
    job.on_reply(b, {"stored": 1, "rejected": []})
    assert [r.ok for r in job.results()] == [False, False, True]


def test_send_job_batches_by_count_and_bytes() -> None:
    job = SendJob(messages(10), batch_size=4)
    assert [len(b.indices) for b in job.plan({"s": route(G1)})] == [4, 4, 2]
    big = [OutgoingMessage("s", b"x" * 600) for _ in range(5)]
    job = SendJob(big, batch_size=64, max_batch_bytes=1500)
    assert [len(b.indices) for b in job.plan({"s": route(G1)})] == [2, 2, 1]


def test_choose_group_spreads_and_avoids_suspects() -> None:
    r = route(G1, G2)
    ids = [OutgoingMessage("s", "").id for _ in range(200)]
    counts = {"g1": 0, "g2": 0}
    for mid in ids:
        group, again = choose_group(r, mid)
        counts[group.name] += 1
        assert not again
    assert min(counts.values()) > 50
    health = GroupHealth(suspect_for_s=5)
    health.failed("g1", now=100.0)
    assert all(choose_group(r, mid, health=health, now=101.0)[0].name == "g2" for mid in ids[:20])
    assert {choose_group(r, mid, health=health, now=106.0)[0].name for mid in ids} == {"g1", "g2"}
    group, again = choose_group(r, ids[0], tried=["g1", "g2"])
    assert again and group is not None
    assert choose_group(route(), ids[0]) == (None, False)


# ---- routes ---------------------------------------------------------------------------------------


def test_routes_parse_cache_and_static() -> None:
    r = parse_route("s", {"subject": "s", "groups": [G1, {**G2, "read_only": True}], "delay_servers": []})
    assert [g.name for g in r.groups] == ["g1", "g2"] and [g.name for g in r.writable_groups] == ["g1"]
    cache = RouteCache(ttl_s=30, empty_ttl_s=1)
    cache.put(r, now=0)
    assert cache.fresh("s", 29) is r and cache.fresh("s", 30) is None and cache.stale("s") is r
    cache.invalidate(["s"])
    assert cache.fresh("s", 1) is None and cache.stale("s") is r
    cache.put(route(subject="t"), now=0)  # no group: asked again soon
    assert cache.fresh("t", 0.5) is not None and cache.fresh("t", 1) is None
    static = static_route("s", ["127.0.0.1:1", "127.0.0.1:2"])
    assert [(g.name, g.addresses) for g in static.writable_groups] == [
        ("127.0.0.1:1", ("127.0.0.1:1",)),
        ("127.0.0.1:2", ("127.0.0.1:2",)),
    ]
    assert parse_address("localhost:20880") == ("localhost", 20880)
    assert parse_address("[::1]:5") == ("::1", 5)
    for bad in ("localhost", ":1", "h:0", "h:x", "h:70000"):
        with pytest.raises(ValueError):
            parse_address(bad)


# ---- the loops, driven by hand: each step answered by the test, no socket ----------------------------


class HandClient(ClientCore):
    """The client core without a driver: the test does its steps."""

    def _open(self) -> None:
        pass


class HandSubscription(SubscriptionCore):
    def _open(self) -> None:
        pass


def finish(loop: Generator[Any, Any, Any], outcome: Any = None) -> Any:
    """Send the last outcome; the loop must end, and its result is returned."""
    with pytest.raises(StopIteration) as end:
        loop.send(outcome)
    return end.value.value


def done(result: Any) -> Future:
    """A finished request put in flight (`Start`): its reply, or the exception it met."""
    future: Future = Future()
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
    return future


META = "127.0.0.1:20880"
ROUTE_REPLY = {"subject": "s", "groups": [G1, G2]}


def test_route_lookup_asks_the_meta_server_once_then_uses_the_cache() -> None:
    book = RouteBook(META)
    loop = book.lookup("s")
    assert next(loop) == Call(META, RequestCode.META_ROUTE, {"subject": "s", "create": True}, META_TIMEOUT_S)
    route_ = finish(loop, ROUTE_REPLY)
    assert [g.name for g in route_.groups] == ["g1", "g2"]
    assert finish(book.lookup("s")) is route_  # fresh: no step at all
    assert isinstance(next(book.lookup("s", refresh=True)), Call)
    assert finish(RouteBook(None, ["127.0.0.1:1"]).lookup("s")).groups[0].name == "127.0.0.1:1"  # static


def test_route_lookup_falls_back_on_the_route_fetched_before() -> None:
    book = RouteBook(META)
    loop = book.lookup("s")
    next(loop)
    with pytest.raises(MetaUnreachable, match="cannot reach the meta server"):  # nothing cached yet
        loop.send(ConnectFailed(META, "refused"))
    loop = book.lookup("s")
    next(loop)
    fetched = finish(loop, ROUTE_REPLY)
    book.invalidate(["s"])  # a send failed: ask again...
    loop = book.lookup("s")
    next(loop)
    assert finish(loop, RemoteError(ErrorCode.UNAVAILABLE, "meta store down")) is fetched  # ...it cannot answer
    assert finish(book.lookup("s")) is fetched  # and is left alone for META_RETRY_S
    loop = book.lookup("s", refresh=True)
    next(loop)
    with pytest.raises(ValueError, match="not a network error"):  # anything else is not a fallback case
        loop.send(ValueError("not a network error"))


def test_send_loop_retries_a_failed_group_on_the_other_with_the_same_ids() -> None:
    client = HandClient(brokers=["127.0.0.1:1", "127.0.0.1:2"])
    messages_ = messages(20)
    loop = client.send(messages_)
    first = next(loop)
    assert isinstance(first, Calls) and {c.address for c in first.calls} == {"127.0.0.1:1", "127.0.0.1:2"}
    assert all(c.code == RequestCode.BROKER_SEND for c in first.calls)
    lost = next(i for i, c in enumerate(first.calls) if c.address == "127.0.0.1:1")
    outcomes = [ConnectionError("lost") if i == lost else {"stored": 1, "rejected": []} for i in range(2)]
    again = loop.send(outcomes)
    assert isinstance(again, Calls) and [c.address for c in again.calls] == ["127.0.0.1:2"]
    assert again.calls[0].body == first.calls[lost].body  # the same messages, the same ids
    results = finish(loop, [{"stored": 1, "rejected": []}])
    assert [r.message_id for r in results] == [m.id for m in messages_]
    assert all(r.ok and r.group == "127.0.0.1:2" for r in results)
    assert client._health.suspect("127.0.0.1:1", time.monotonic())  # the next send goes elsewhere first


def test_send_loop_waits_before_offering_a_message_to_a_group_that_failed_it() -> None:
    client = HandClient(brokers=["127.0.0.1:1"])
    loop = client.send(messages(1))
    next(loop)
    assert loop.send([RemoteError(ErrorCode.UNAVAILABLE, "store")]) == Sleep(RETRY_DELAY_S)
    assert isinstance(loop.send(None), Calls)
    [result] = finish(loop, [{"stored": 1, "rejected": []}])
    assert result.ok


def test_send_loop_asks_the_meta_server_again_while_no_group_takes_the_subject() -> None:
    client = HandClient(meta=META, delivery_timeout_s=60.0)
    loop = client.send(messages(3))
    assert next(loop).code == RequestCode.META_ROUTE
    assert loop.send({"subject": "s", "groups": []}) == Sleep(RETRY_DELAY_S)  # no broker yet
    again = loop.send(None)
    assert isinstance(again, Call) and again.code == RequestCode.META_ROUTE  # not the cached empty route
    assert loop.send(ConnectFailed(META, "refused")) == Sleep(2 * RETRY_DELAY_S)  # the meta server restarts
    assert loop.send(None).code == RequestCode.META_ROUTE
    sends = loop.send(ROUTE_REPLY)
    assert isinstance(sends, Calls)
    results = finish(loop, [{"stored": 1, "rejected": []}] * len(sends.calls))
    assert all(r.ok for r in results)
    quick = HandClient(meta=META, delivery_timeout_s=0.0)
    loop = quick.send(messages(1))
    next(loop)
    [result] = finish(loop, {"subject": "s", "groups": []})
    assert result.error == "no writable broker group carries subject 's'"


def test_client_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="delivery_timeout_s must be at least 0"):
        HandClient(meta=META, delivery_timeout_s=-1)


def test_send_loop_asks_for_the_route_again_after_a_failure() -> None:
    client = HandClient(meta=META)
    loop = client.send(messages(4))
    assert next(loop).code == RequestCode.META_ROUTE
    sends = loop.send(ROUTE_REPLY)
    assert isinstance(sends, Calls)
    refresh = loop.send([ConnectionError("lost")] * len(sends.calls))
    assert isinstance(refresh, Call) and refresh.code == RequestCode.META_ROUTE  # not the cached one
    retry = loop.send(ROUTE_REPLY)
    results = finish(loop, [{"stored": 4, "rejected": []}] * len(retry.calls))
    assert all(r.ok for r in results)


def test_send_one_raises_what_the_broker_rejected() -> None:
    loop = HandClient(brokers=["127.0.0.1:1"]).send_one("s", "x")
    next(loop)
    with pytest.raises(SendError, match="BAD_REQUEST: no"):
        loop.send([{"stored": 0, "rejected": [[0, ErrorCode.BAD_REQUEST, "no"]]}])


def test_cancel_asks_every_delay_server_and_names_one_it_could_not_ask() -> None:
    client = HandClient(brokers=["127.0.0.1:1"], delay_servers=["127.0.0.1:7", "127.0.0.1:8"])
    loop = client.cancel(["a", "b"])
    step = next(loop)
    assert [(c.address, c.body) for c in step.calls] == [
        ("127.0.0.1:7", {"ids": ["a", "b"]}),
        ("127.0.0.1:8", {"ids": ["a", "b"]}),
    ]
    assert finish(loop, [{"outcomes": ["unknown", "too_late"]}, {"outcomes": ["cancelled", "unknown"]}]) == {
        "a": "cancelled",
        "b": "too_late",
    }
    loop = client.cancel(["a"])
    next(loop)
    with pytest.raises(ClientError, match=r"127\.0\.0\.1:8"):
        loop.send([{"outcomes": ["unknown"]}, ConnectionError("lost")])


def subscribed(*addresses: str, prefetch: bool = False) -> HandSubscription:
    """A subscription registered with every broker of a static route (the registration's pulls came
    back empty)."""
    client = HandClient(brokers=list(addresses))
    subscription = HandSubscription(client, SubscribeOptions("order.created", "billing", "c1", prefetch=prefetch))
    loop = subscription._register()
    assert next(loop) == GetRoute("order.created")
    starts = [loop.send(finish(client.route("order.created")))]
    starts += [loop.send(done({"batches": []})) for _ in addresses[1:]]
    assert all(isinstance(s, Start) and s.call.body["wait_ms"] == 0 for s in starts)
    assert isinstance(loop.send(done({"batches": []})), WaitAll)
    finish(loop)
    return subscription


def pull_now(subscription: HandSubscription, ids: list[str]) -> list[Any]:
    """A pull without waiting from a subscription of one broker, whose reply holds `ids`."""
    loop = subscription.pull(10, 0)
    assert isinstance(next(loop), Start)
    assert isinstance(loop.send(done({"batches": [batch("order.created", 0, ids)]})), WaitAll)
    return finish(loop)


def test_pull_round_returns_the_first_group_with_messages_and_leaves_the_other_in_flight() -> None:
    subscription = subscribed(A, B)
    loop = subscription.pull(10, 2.0)
    starts = [next(loop)]
    a_reply, b_reply = Future(), Future()
    starts.append(loop.send(a_reply))
    assert [s.call.address for s in starts] == [A, B] and starts[0].call.body["max"] == 10
    wait = loop.send(b_reply)
    assert isinstance(wait, WaitAny) and wait.handles == [a_reply, b_reply] and 0 < wait.timeout_s <= 2.0
    b_reply.set_result({"batches": [batch("order.created", 0, ["m1", "m2"])]})
    deliveries = finish(loop)
    assert [(d.id, d.broker) for d in deliveries] == [("m1", B), ("m2", B)]
    # A's pull is still in flight: the next round waits on it without pulling A again.
    loop = subscription.pull(10, 2.0)
    start_b = next(loop)
    assert start_b.call.address == B and start_b.call.body["pulled"] == {"order.created": 1}
    wait = loop.send(Future())
    assert a_reply in wait.handles
    a_reply.set_result({"batches": [batch("order.created", 0, ["m3"])]})
    assert [d.id for d in finish(loop)] == ["m3"]


def test_pull_takes_buffered_deliveries_without_a_step() -> None:
    subscription = subscribed(A)
    assert [d.id for d in pull_now(subscription, ["m1", "m2", "m3"])] == ["m1", "m2", "m3"]
    subscription._buffer.extend(subscription._state.accept(A, {"batches": [batch("order.created", 3, ["m4", "m5"])]}))
    assert [d.id for d in finish(subscription.pull(1, 2.0))] == ["m4"]
    assert [d.id for d in subscription.take_buffered()] == ["m5"]


def test_acks_flush_as_one_request_per_broker_an_ack_lost_goes_again_a_refused_one_forgets_the_tracker() -> None:
    subscription = subscribed(A)
    deliveries = pull_now(subscription, ["m1", "m2"])
    assert not any(subscription._finish(d) for d in deliveries)  # not due yet: they wait for a flush
    ack = Calls([Call(A, RequestCode.BROKER_ACK, {"acks": [["order.created", "billing", "c1", 1]]}, ACK_TIMEOUT_S)])
    for lost in (ConnectionError("lost"), TimeoutError("no reply"), RemoteError(ErrorCode.NOT_MASTER, "replica")):
        loop = subscription.flush()
        assert next(loop) == ack
        finish(loop, [lost])
        assert subscription._state.is_current(deliveries[0])  # kept: the same ack goes again
    loop = subscription.flush()
    assert next(loop) == ack
    finish(loop, [RemoteError(ErrorCode.UNKNOWN_CONSUMER, "beyond what was handed out")])
    assert not subscription._state.is_current(deliveries[0])  # the broker delivers them again
    assert subscription._state.pull_request(A, 10, 0)["pulled"] == {}
    assert finish(subscription.flush()) is None  # nothing left to send: no step


def test_acks_go_out_beside_the_next_long_poll_not_before_it() -> None:
    """A pull about to wait puts the finished acknowledgements in flight and starts its long poll at
    once (one round trip sooner); a refused ack seen later forgets its tracker as a flush would, and
    an explicit flush waits for the acks still in flight."""
    subscription = subscribed(A)
    deliveries = pull_now(subscription, ["m1", "m2"])
    for d in deliveries:
        subscription._finish(d)
    loop = subscription.pull(10, 2.0)
    ack = next(loop)
    assert isinstance(ack, Start) and ack.call == Call(
        A, RequestCode.BROKER_ACK, {"acks": [["order.created", "billing", "c1", 1]]}, ACK_TIMEOUT_S
    )
    ack_reply: Future = Future()
    pull = loop.send(ack_reply)
    assert isinstance(pull, Start) and pull.call.code == RequestCode.BROKER_PULL  # the ack's answer not awaited
    pull_reply: Future = Future()
    wait = loop.send(pull_reply)
    assert isinstance(wait, WaitAny) and wait.handles == [pull_reply]
    flush = subscription.flush()
    assert next(flush) == WaitAll([ack_reply], ACK_TIMEOUT_S + PULL_REPLY_GRACE_S)  # nothing new: waits
    ack_reply.set_exception(RemoteError(ErrorCode.UNKNOWN_CONSUMER, "never handed out"))
    assert finish(flush) is None
    assert not subscription._state.is_current(deliveries[0])  # the broker delivers them again
    pull_reply.set_result({"batches": []})


def test_pulls_acks_and_heartbeats_name_the_epoch_of_their_group() -> None:
    subscription = subscribed(A)
    update_slots(
        subscription._slots, parse_route("order.created", {"groups": [{"name": A, "addresses": [A], "epoch": 7}]})
    )
    loop = subscription.pull(10, 0)
    start = next(loop)
    assert start.call.code == RequestCode.BROKER_PULL and start.call.body["epoch"] == 7
    loop.send(done({"batches": [batch("order.created", 0, ["m1"])]}))
    [delivery] = finish(loop)
    subscription._finish(delivery)
    flush = subscription.flush()
    [ack] = next(flush).calls
    assert ack.code == RequestCode.BROKER_ACK and ack.body["epoch"] == 7
    finish(flush, [{}])
    beat = subscription.heartbeat()
    [heartbeat] = next(beat).calls
    assert heartbeat.code == RequestCode.BROKER_HEARTBEAT and heartbeat.body["epoch"] == 7


def test_after_a_failover_acks_heartbeats_nacks_and_pulls_go_to_the_groups_new_master() -> None:
    """A replicated group's pull logs replicate with its journal: the new master knows the pull
    sequences its old master handed out (maybe not the last ones, nor the last acks), so what the
    consumer holds is acknowledged there instead of being forgotten and delivered again. Acks wait
    for the new master's first pull reply, which says where its pull log ends."""
    subscription = subscribed(A)
    g1 = {"name": "g1", "addresses": [A, B], "epoch": 3}
    subscription._slots.clear()  # the route names one replicated group, g1, its master at A
    subscription._take_route(parse_route("order.created", {"groups": [g1]}))
    loop = subscription.pull(10, 0)
    start = next(loop)
    assert start.call.address == A
    loop.send(done({"batches": [batch("order.created", 0, ["m1", "m2", "m3"])]}))
    d1, d2, d3 = finish(loop)
    assert (d1.broker, d1.broker_group) == (A, "g1")
    subscription._finish(d1)
    flush = subscription.flush()
    assert next(flush).calls[0].address == A
    finish(flush, [{}])  # A took the ack of m1: maybe not copied to B before A was lost
    # A is lost; the route now names B, the replica promoted, with the group's next epoch.
    subscription._take_route(parse_route("order.created", {"groups": [{**g1, "addresses": [B], "epoch": 4}]}))
    beat = subscription.heartbeat()
    [heartbeat] = next(beat).calls
    assert heartbeat.address == B and heartbeat.body["consumers"] == [["order.created", "billing", "c1"]]
    assert heartbeat.body["epoch"] == 4
    finish(beat, [{}])
    nack = subscription.nack(d2, 1.0)
    call = next(nack)
    assert call.address == B and call.code == RequestCode.BROKER_NACK and call.body["epoch"] == 4
    finish(nack, {"outcomes": [["retry", 1]]})
    assert finish(subscription.flush()) is None  # no ack before B answered a pull
    loop = subscription.pull(10, 0)
    start = next(loop)  # (no ack in flight beside it)
    assert start.call.address == B and start.call.body["pulled"] == {"order.created": 2}
    # B never got the entry of A's last pull: it says where its pull log ends and hands out nothing.
    # What lies below is the same on B and stays; d3 is forgotten: B hands its message out again.
    loop.send(done({"batches": [{**batch("order.created", 2, []), "behind": True}]}))
    assert finish(loop) == []
    state = subscription._state
    assert not state.is_current(d3) and state.is_current(d2) and not state.done(d3)
    assert state.pull_request("g1", 10, 0)["pulled"] == {"order.created": 1}
    # B may not have A's last acks: the whole finished prefix goes, m1's ack again.
    flush = subscription.flush()
    assert next(flush) == Calls(
        [Call(B, RequestCode.BROKER_ACK, {"acks": [["order.created", "billing", "c1", 1]], "epoch": 4}, ACK_TIMEOUT_S)]
    )
    finish(flush, [{}])
    [again] = state.accept("g1", {"batches": [batch("order.created", 2, ["m3"])]}, address=B)
    assert (again.pull_seq, again.broker) == (2, B) and state.is_current(again) and not state.is_current(d3)
    state.done(again)
    assert state.take_acks() == {"g1": [["order.created", "billing", "c1", 2]]}


def test_a_tracker_cut_below_everything_it_held_is_dropped(state: SubscriptionState) -> None:
    [d1] = state.accept(A, {"batches": [batch("order.created", 5, ["m1"])]})
    assert state.accept(A, {"batches": [{**batch("order.created", 3, []), "behind": True}]}) == []
    assert not state.is_current(d1)
    assert state.pull_request(A, 10, 0)["pulled"] == {}  # from the broker's acknowledged point


def test_prefetch_puts_the_next_pull_in_flight_before_handing_out_a_reply() -> None:
    subscription = subscribed(A, prefetch=True)
    loop = subscription.pull(2, 1.0)
    assert isinstance(next(loop), Start)
    assert isinstance(loop.send(done({"batches": [batch("order.created", 0, ["m1", "m2", "m3"])]})), WaitAny)
    ahead = loop.send(None)  # the reply is in: the next pull goes out before m1 and m2 are handed out
    assert isinstance(ahead, Start) and ahead.call.body["pulled"] == {"order.created": 2}
    reply: Future = Future()
    assert [d.id for d in finish(loop, reply)] == ["m1", "m2"]
    assert [d.id for d in finish(subscription.pull(2, 1.0))] == ["m3"]  # buffered; the pull ahead still out
    reply.set_result({"batches": [batch("order.created", 3, ["m4"])]})
    loop = subscription.pull(2, 1.0)
    assert next(loop) == WaitAny([reply], pytest.approx(1.0, abs=0.5))  # taken without asking again
    assert isinstance(loop.send(None), Start)  # and the next one goes ahead
    assert [d.id for d in finish(loop, Future())] == ["m4"]
    without = subscribed(A)
    assert [d.id for d in pull_now(without, ["m1"])] == ["m1"]
    assert not any(s.pending for s in without._slots.values())  # no prefetch: nothing in flight


def test_a_delivery_is_made_with_every_field_of_the_dataclass() -> None:
    """Deliveries are made without the dataclass's __init__ (`qmq.client.messages.set_fields`): each
    must still have exactly its fields, compare and copy like one made by the constructor."""
    state = SubscriptionState(SubscribeOptions("order.created", "billing", "c1"))
    [delivery] = state.accept(A, {"batches": [batch("order.created", 0, ["m1"])]})
    assert set(vars(delivery)) == {f.name for f in dataclasses.fields(Delivery)}
    again = Delivery(**vars(delivery))
    assert dataclasses.asdict(again) == dataclasses.asdict(delivery)
    assert dataclasses.replace(delivery, attempt=2).attempt == 2 and not delivery.is_retry
    with pytest.raises(dataclasses.FrozenInstanceError):
        delivery.attempt = 3  # type: ignore[misc]


def test_a_pull_whose_reply_never_comes_is_given_up_after_its_grace() -> None:
    """A driver may put requests in flight that nothing times out (the blocking one, on an open
    connection): the loop itself gives up on a pull past its wait and grace, and pulls again."""
    subscription = subscribed(A)
    loop = subscription.pull(10, 0)
    assert isinstance(next(loop), Start)
    assert isinstance(loop.send(Future()), WaitAll)  # never answered
    [slot] = subscription._slots.values()
    slot.due -= PULL_REPLY_GRACE_S + 1  # as if the grace had passed
    assert finish(loop) == []
    assert slot.pending is None and slot.failures == 1  # a failure: retried at once by the next pull
    assert isinstance(next(subscription.pull(10, 0)), Start)


def test_a_refused_subscription_raises_and_a_lost_broker_rests() -> None:
    subscription = subscribed(A)
    loop = subscription.pull(10, 0)
    next(loop)
    loop.send(done(RemoteError(ErrorCode.BAD_REQUEST, "bad group")))
    with pytest.raises(ClientError, match="refused to serve"):
        loop.send(None)
    loop = subscription.pull(10, 5.0)
    step = next(loop)
    for _ in range(2):
        assert isinstance(step, Start)
        handle: Future = Future()
        assert isinstance(loop.send(handle), WaitAny)
        handle.set_exception(ConnectionError("lost"))
        step = loop.send(None)  # the first failure is retried at once (a reconnect)...
    # ...after the second the broker is left alone a while: with no pull in flight the round sleeps.
    assert isinstance(step, Sleep) and 0 < step.seconds <= pull_retry_delay_s(2)


def test_nack_returns_the_brokers_outcome_or_none_when_it_cannot_be_made() -> None:
    subscription = subscribed(A)
    d1, d2 = pull_now(subscription, ["m1", "m2"])
    loop = subscription.nack(d1, 1.5, reason="boom")
    step = next(loop)
    assert step.code == RequestCode.BROKER_NACK and step.body["nacks"][0]["delay_ms"] == 1500
    assert finish(loop, {"outcomes": [["retry", 123]]}) == ("retry", 123)
    loop = subscription.nack(d2)
    next(loop)
    assert finish(loop, TimeoutError("slow")) is None
    assert not subscription._state.is_current(d2)  # forgotten: the broker delivers it again
    assert finish(subscription.nack(d2)) is None  # a stale delivery is not nacked at all
