"""`qmq broker` as a real process over real sockets: bad input, per-message send results, registration
with a real meta server and its read-only flag, metrics, and consumption state across a clean restart."""

from __future__ import annotations

import signal
import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from qmq.broker import snapshot
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Connection, Role
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.frame import LENGTH, Flags, Frame, encode_frame
from qmq.protocol.limits import MAX_FRAME_BYTES, MAX_MESSAGE_BYTES
from tests.support.broker import HOST, Broker, RawConsumer, restart_broker, send, start_broker
from tests.support.metrics import sample, scrape
from tests.support.processes import ProcessManager, free_port, wait_for_port
from tests.support.replication import wait_role
from tests.test_meta import log_text, start_meta, wait_until
from tests.test_net import assert_connection_error_frame, raw_exchange

TOKEN = "secret"
HEARTBEAT_DEADLINE_S = 15.0  # the meta server asks for a heartbeat every 10 s


def handshake(token: str | None = TOKEN) -> bytes:
    return Connection(Role.CLIENT, client_id="raw", token=token).start_handshake()[1]


def assert_request_error_frame(frame: Frame, request_id: int, code: ErrorCode) -> None:
    """A fatal error in answer to one request: that request's id, then the connection is closed."""
    assert frame.flags == Flags.RESPONSE | Flags.ERROR
    assert frame.request_id == request_id
    assert frame.body is not None and frame.body["code"] == code, frame.body
    assert frame.body["message"]


def pull(conn: BlockingConnection, subject: str, group: str, consumer: str, **fields: Any) -> dict[str, Any]:
    body = {"subject": subject, "group": group, "consumer": consumer, "wait_ms": 0, **fields}
    return conn.request(RequestCode.BROKER_PULL, body)


def ids(reply: dict[str, Any]) -> list[str]:
    return [m["id"] for batch in reply["batches"] for m in batch["messages"]]


# -- bad input ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_broker(tmp_path_factory):
    """One broker with a token, shared by the bad-input cases (each uses subjects of its own)."""
    manager = ProcessManager(tmp_path_factory.mktemp("broker-bad-input"))
    try:
        yield start_broker(manager, tmp_path_factory.mktemp("data"), "--token", TOKEN)
    finally:
        manager.stop_all()


# Each case: the bytes a bad client sends (given the subject its bystander uses), the frames the broker
# answers with before closing (the handshake reply, if the handshake was good), and the error code.
BAD_INPUT: dict[str, tuple[Callable[[str], bytes], int, ErrorCode]] = {
    "garbage": (lambda s: b"\x00\x00\x00\x05hello world", 0, ErrorCode.BAD_FRAME),
    "http": (lambda s: b"GET /metrics HTTP/1.1\r\nHost: qmq\r\n\r\n", 0, ErrorCode.FRAME_TOO_LARGE),
    "oversized-frame": (
        lambda s: handshake() + LENGTH.pack(MAX_FRAME_BYTES + 1) + b"\x01\x00",
        1,
        ErrorCode.FRAME_TOO_LARGE,
    ),
    "wrong-token": (lambda s: handshake("wrong") + encode_frame(RequestCode.PING, 2, {}), 0, ErrorCode.UNAUTHORIZED),
    "no-token": (
        lambda s: handshake(None) + encode_frame(RequestCode.BROKER_SEND, 2, {"messages": []}),
        0,
        ErrorCode.UNAUTHORIZED,
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_a_bad_client_gets_an_error_frame_and_is_closed_while_others_carry_on(token_broker: Broker, case) -> None:
    data, replies_before, code = BAD_INPUT[case]
    subject = f"bad.{case}"
    with token_broker.connect(token=TOKEN, client_id="bystander") as conn:
        bystander = RawConsumer(conn, subject, "g", "bystander")
        assert bystander.pull(wait_ms=0) == []  # the group starts at the latest message
        assert send(conn, subject, ["before-1", "before-2"]) == {"stored": 2, "rejected": []}
        got = bystander.pull(max_count=1)
        assert [d.id for d in got] == ["before-1"]  # holds pull seq 0, unacked, during the bad exchange

        frames = raw_exchange(token_broker.port, data(subject))  # returns once the broker closed it

        assert len(frames) == replies_before + 1, frames
        if replies_before:
            assert frames[0].flags == Flags.RESPONSE and frames[0].request_id == 1  # the handshake reply
        if code == ErrorCode.UNKNOWN_REQUEST:
            assert_request_error_frame(frames[-1], 2, code)
        else:
            assert_connection_error_frame(frames[-1], code)

        assert send(conn, subject, ["after"]) == {"stored": 1, "rejected": []}
        got += bystander.pull(max_count=10)
        assert [d.id for d in got] == ["before-1", "before-2", "after"]
        bystander.ack(got)
        assert bystander.pull(wait_ms=0) == []
    assert token_broker.proc.poll() is None


def test_an_ack_or_nack_of_what_this_broker_never_handed_out_is_refused_and_the_connection_stays(
    token_broker: Broker,
) -> None:
    """UNKNOWN_CONSUMER answers the request alone: after a failover a correct client acknowledges to
    the group's new master pull sequences it may never have got (docs/replication.md), and its other
    requests on the connection (its pull in flight, other subscriptions') must not fail with it."""
    subject = "bad.unknown-consumer"
    with token_broker.connect(token=TOKEN, client_id="bystander") as conn:
        bystander = RawConsumer(conn, subject, "g", "bystander")
        assert bystander.pull(wait_ms=0) == []
        send(conn, subject, ["m0"])
        got = bystander.pull(max_count=1)  # holds pull seq 0, unacked
        never_served = {"subject": subject, "group": "nogroup", "consumer": "c", "pull_seq": 0, "delay_ms": 0}
        refused = [
            (RequestCode.BROKER_ACK, {"acks": [["s", "nogroup", "c", 0]]}),  # a subject never served
            (RequestCode.BROKER_ACK, {"acks": [[subject, "g", "stranger", 0]]}),  # a consumer never served
            (RequestCode.BROKER_ACK, {"acks": [[subject, "g", "bystander", 1000]]}),  # beyond what it pulled
            (RequestCode.BROKER_NACK, {"nacks": [never_served]}),
        ]
        with token_broker.connect(token=TOKEN, client_id="confused") as other:
            for code, body in refused:
                with pytest.raises(RemoteError) as error:
                    other.request(code, body)
                assert error.value.code == ErrorCode.UNKNOWN_CONSUMER, (code, body)
                assert error.value.message
            assert other.request(RequestCode.PING, {}) == {}  # the same connection, still served
        bystander.ack(got)
        assert bystander.pull(wait_ms=0) == []
    assert token_broker.proc.poll() is None


def test_the_token_is_required(token_broker: Broker) -> None:
    for token in (None, "wrong", TOKEN + " "):
        with pytest.raises(RemoteError) as refused:
            token_broker.connect(token=token)
        assert refused.value.code == ErrorCode.UNAUTHORIZED
    with token_broker.connect(token=TOKEN) as conn:
        assert conn.request(RequestCode.PING, {"ok": 1}) == {"ok": 1}


# -- per-message send results and non-fatal request errors -----------------------------------------------


def test_each_message_of_a_send_is_accepted_or_rejected_on_its_own(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "b")
    big = bytes(range(256)) * (MAX_MESSAGE_BYTES // 256)  # exactly at the limit: accepted
    messages = [
        {"id": "m0", "subject": "orders", "payload": b"first", "key": "k0", "tags": ["t1", "t:2"]},
        {"id": "m1", "subject": "bad subject!", "payload": b"x"},
        {"id": "m2", "subject": "%RETRY%orders%g", "payload": b"x"},
        {"id": "m3", "subject": "orders", "payload": b"x" * (MAX_MESSAGE_BYTES + 1)},
        {"id": "m4", "subject": "orders", "payload": b"x", "tags": ["bad tag!"]},
        {"id": "m5", "subject": "%DEAD%orders%g", "payload": b"x"},
        {"id": "m6", "subject": "%ACTION%", "payload": b"x"},
        {"id": "m7", "subject": "orders", "payload": big},
        {"id": "", "subject": "orders", "payload": b"x"},
        {"id": "m9", "subject": "orders", "payload": "not bytes"},
        {"id": "m10", "subject": "orders", "payload": b"last", "key": None, "tags": []},
        "not a map",
    ]
    with broker.connect() as conn:
        reply = conn.request(RequestCode.BROKER_SEND, {"messages": messages}, timeout=60)
        assert reply["stored"] == 3
        rejected = {index: code for index, code, _ in reply["rejected"]}
        assert rejected == {
            1: ErrorCode.BAD_SUBJECT,
            2: ErrorCode.BAD_SUBJECT,
            3: ErrorCode.MESSAGE_TOO_LARGE,
            4: ErrorCode.BAD_REQUEST,
            5: ErrorCode.BAD_SUBJECT,
            6: ErrorCode.BAD_SUBJECT,
            8: ErrorCode.BAD_REQUEST,
            9: ErrorCode.BAD_REQUEST,
            11: ErrorCode.BAD_REQUEST,
        }
        assert all(isinstance(message, str) and message for _, _, message in reply["rejected"])
        assert "bad tag!" in next(m for i, _, m in reply["rejected"] if i == 4)

        got = pull(conn, "orders", "g", "c", start="earliest")["batches"]
        assert [b["subject"] for b in got] == ["orders"]  # nothing reached %RETRY%orders%g
        (batch,) = got
        assert [(m["id"], m["key"], m["tags"], m["attempt"]) for m in batch["messages"]] == [
            ("m0", "k0", ["t1", "t:2"], 1),
            ("m7", None, [], 1),
            ("m10", None, [], 1),
        ]
        assert batch["messages"][1]["payload"] == big
        stats = conn.request(RequestCode.BROKER_STATS)
        assert stats["subjects"] == {"orders": {"stored": 3}}


def test_a_message_with_a_subject_of_the_wrong_type_is_rejected_alone(processes, tmp_path) -> None:
    """A subject that is a list or a map is a bad subject like any other, not an INTERNAL failure of the
    whole batch (the good message next to it must still be stored)."""
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        reply = conn.request(
            RequestCode.BROKER_SEND,
            {
                "messages": [
                    {"id": "ok", "subject": "orders", "payload": b"x"},
                    {"id": "list", "subject": ["orders"], "payload": b"x"},
                    {"id": "map", "subject": {"a": 1}, "payload": b"x"},
                ]
            },
        )
        assert reply["stored"] == 1
        rejected = [(i, code) for i, code, _ in reply["rejected"]]
        assert rejected == [(1, ErrorCode.BAD_SUBJECT), (2, ErrorCode.BAD_SUBJECT)]


def test_an_ack_naming_its_consumer_with_a_list_is_a_bad_request_not_an_internal_error(processes, tmp_path) -> None:
    """docs/broker.md: a field of the wrong type is BAD_REQUEST (and the connection stays open)."""
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        consumer = RawConsumer(conn, "orders", "g", "c", options={"start": "earliest"})
        send(conn, "orders", ["a"])
        assert [d.id for d in consumer.pull()] == ["a"]
        with pytest.raises(RemoteError) as failed:
            conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", ["c"], 0]]})
        assert failed.value.code == ErrorCode.BAD_REQUEST, failed.value
        assert conn.request(RequestCode.PING, {"still": "open"}) == {"still": "open"}


def test_a_heartbeat_naming_its_group_with_a_list_is_ignored_or_refused_not_an_internal_error(
    processes, tmp_path
) -> None:
    """A malformed heartbeat item is a BAD_REQUEST (not INTERNAL), and the connection stays usable."""
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        consumer = RawConsumer(conn, "orders", "g", "c", options={"start": "earliest"})
        send(conn, "orders", ["a"])
        assert [d.id for d in consumer.pull()] == ["a"]
        assert conn.request(RequestCode.BROKER_HEARTBEAT, {"consumers": [["orders", "g", "c"]]}) == {}
        for bad in ([["orders", "g", "c"], [1, 2]], [["orders", ["g"], "c"]]):
            with pytest.raises(RemoteError) as err:
                conn.request(RequestCode.BROKER_HEARTBEAT, {"consumers": bad})
            assert err.value.code == ErrorCode.BAD_REQUEST, err.value
        assert conn.request(RequestCode.PING, {"still": "open"}) == {"still": "open"}


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        ({}, ErrorCode.BAD_REQUEST, "'subject'"),
        ({"subject": "s"}, ErrorCode.BAD_REQUEST, "group"),
        ({"subject": "s", "group": "g"}, ErrorCode.BAD_REQUEST, "consumer"),
        ({"subject": "s", "group": "g", "consumer": "c", "max": 0}, ErrorCode.BAD_REQUEST, "'max'"),
        ({"subject": "s", "group": "g", "consumer": "c", "wait_ms": "soon"}, ErrorCode.BAD_REQUEST, "'wait_ms'"),
        ({"subject": "s", "group": "g", "consumer": "c", "pulled": [1]}, ErrorCode.BAD_REQUEST, "'pulled'"),
        ({"subject": "s", "group": "g", "consumer": "c", "pulled": {"s": "x"}}, ErrorCode.BAD_REQUEST, "pulled"),
        ({"subject": "s", "group": "g", "consumer": "c", "start": "middle"}, ErrorCode.BAD_REQUEST, "start"),
        ({"subject": "s", "group": "g", "consumer": "c", "tags": ["a b"]}, ErrorCode.BAD_REQUEST, "tag"),
        ({"subject": "s", "group": "-g", "consumer": "c"}, ErrorCode.BAD_REQUEST, "group"),
        ({"subject": "s", "group": "g", "consumer": "c d"}, ErrorCode.BAD_REQUEST, "consumer"),
        ({"subject": "%RETRY%s%g", "group": "g", "consumer": "c"}, ErrorCode.BAD_SUBJECT, "may only contain"),
        ({"subject": "s" * 190, "group": "g" * 20, "consumer": "c"}, ErrorCode.BAD_REQUEST, "too long"),
    ],
)
def test_a_bad_pull_is_answered_and_the_connection_stays_usable(token_broker: Broker, body, code, words) -> None:
    with token_broker.connect(token=TOKEN) as conn:
        consumer = RawConsumer(conn, "pull.errors", f"g{uuid.uuid4().hex[:12]}", "c")
        assert consumer.pull(wait_ms=0) == []
        with pytest.raises(RemoteError) as failed:
            conn.request(RequestCode.BROKER_PULL, {"wait_ms": 0, **body})
        assert failed.value.code == code
        assert words in failed.value.message
        send(conn, "pull.errors", ["x"])
        assert [d.id for d in consumer.pull()] == ["x"]


# -- registration with the meta server ----------------------------------------------------------------


def test_registers_in_its_group_follows_the_read_only_flag_and_unregisters_at_sigterm(processes, tmp_path) -> None:
    meta_proc, meta_port = start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}")
    broker = start_broker(processes, tmp_path / "b", "--meta", f"{HOST}:{meta_port}", "--group", "g1")
    with BlockingConnection.open(HOST, meta_port, client_id="meta-test") as meta, broker.connect() as conn:

        def listed() -> dict | None:
            servers = meta.request(RequestCode.META_LIST)["servers"]
            return next((s for s in servers if s["address"] == broker.address and s["available"]), None)

        server = wait_until(listed, "the broker to register")
        assert (server["kind"], server["group"], server["unregistered_at"]) == ("broker", "g1", None)

        def routed() -> dict | None:  # a route names the master once the meta server chose it
            route = meta.request(RequestCode.META_ROUTE, {"subject": "orders", "create": True})
            return route if route["groups"] and route["groups"][0].get("master") else None

        route = wait_until(routed, "the meta server to name the group's master")
        # The broker takes office a moment later (the heartbeat's reply, then its consumption state):
        # until then it answers NOT_MASTER "pending", which clients retry.
        wait_role(broker, "master")
        assert route["groups"] == [
            {
                "name": "g1",
                "addresses": [broker.address],
                "available": True,
                "read_only": False,
                "master": broker.address,  # the first broker of a group is its master (docs/replication.md)
                "epoch": 1,
            }
        ]
        assert conn.request(RequestCode.BROKER_STATS)["group"] == "g1"

        consumer = RawConsumer(conn, "orders", "c", "c1")
        assert consumer.pull(wait_ms=0) == []
        assert send(conn, "orders", ["w1"])["stored"] == 1

        assert meta.request(RequestCode.META_SET_READ_ONLY, {"group": "g1", "read_only": True})["changed"]
        # The broker learns the flag from the reply to its next heartbeat (at most 10 s away).
        wait_until(
            lambda: conn.request(RequestCode.BROKER_STATS)["read_only"],
            "the broker to become read-only",
            HEARTBEAT_DEADLINE_S,
        )
        with pytest.raises(RemoteError) as refused:
            send(conn, "orders", ["ro"])
        assert refused.value.code == ErrorCode.READ_ONLY
        assert "g1" in refused.value.message
        # Consumers still drain a read-only group.
        got = consumer.pull()
        assert [d.id for d in got] == ["w1"]
        consumer.ack(got)

    assert processes.kill(broker.proc, signal.SIGTERM) == 0
    with BlockingConnection.open(HOST, meta_port, client_id="meta-test") as meta:
        servers = {s["address"]: s for s in meta.request(RequestCode.META_LIST)["servers"]}
        assert servers[broker.address]["available"] is False
        assert servers[broker.address]["unregistered_at"] is not None
        route = meta.request(RequestCode.META_ROUTE, {"subject": "orders", "create": False})
        assert [(g["name"], g["available"]) for g in route["groups"]] == [("g1", False)]
    assert f"server {broker.address} unregistered" in log_text(meta_proc)


# -- metrics ------------------------------------------------------------------------------------------


def test_metrics_count_stored_messages_and_requests_and_show_group_gauges(processes, tmp_path) -> None:
    metrics_port = free_port()
    # A consumer timeout of 12 s sweeps (and refreshes the gauges) every 3 s, and keeps c2's messages
    # unreleased for longer than this test takes.
    broker = start_broker(processes, tmp_path / "b", "--metrics-port", str(metrics_port), "--consumer-timeout", "12")
    wait_for_port(metrics_port, broker.proc)
    with broker.connect() as conn:
        acking = RawConsumer(conn, "orders", "g1", "c1", options={"start": "earliest"})
        holding = RawConsumer(conn, "orders", "g2", "c2", options={"start": "earliest"})
        assert send(conn, "orders", [f"m{i}" for i in range(5)])["stored"] == 5
        assert send(conn, "other", ["o1"])["stored"] == 1
        got = acking.pull(max_count=2)
        acking.ack(got)
        assert len(holding.pull(max_count=10)) == 5
        with pytest.raises(RemoteError):
            conn.request(RequestCode.BROKER_PULL, {})

    text = scrape(metrics_port)
    assert sample(text, "qmq_broker_messages_stored_total", subject="orders") == 5
    assert sample(text, "qmq_broker_messages_stored_total", subject="other") == 1
    assert sample(text, "qmq_broker_requests_total", request="broker_send") == 2
    assert sample(text, "qmq_broker_requests_total", request="broker_pull") == 3
    assert sample(text, "qmq_broker_requests_total", request="broker_ack") == 1
    assert sample(text, "qmq_broker_request_errors_total", request="broker_pull", error="BAD_REQUEST") == 1
    assert sample(text, "qmq_broker_read_only") == 0
    assert sample(text, "qmq_broker_messages_stored_total", subject="%ACTION%") is None  # journal not counted
    fsyncs = sample(text, "qmq_broker_fsyncs_total", thread="flusher")
    assert fsyncs is not None and fsyncs >= 3  # each send and pull waited for one (acks are journalled too)
    assert sample(text, "qmq_broker_fsyncs_total", thread="caller") == 0  # only a caught-up replica syncs itself
    assert sample(text, "qmq_broker_fsync_seconds_count") >= fsyncs  # observed as each one ends
    assert sample(text, "qmq_broker_fsync_seconds_sum") > 0

    idle_conn = broker.connect()
    idle = RawConsumer(idle_conn, "idle", "g3", "c3")
    waiting = threading.Thread(target=idle.pull, kwargs={"wait_ms": 30_000})
    waiting.start()  # a long poll held open while the gauges are read

    def gauges() -> str | None:
        text = scrape(metrics_port)
        published = sample(text, "qmq_broker_in_flight", subject="orders", group="g2") is not None
        return text if published and sample(text, "qmq_broker_pulls_waiting", subject="idle") is not None else None

    text = wait_until(gauges, "the sweep loop to publish the group gauges", 10.0)
    assert sample(text, "qmq_broker_pulls_waiting", subject="idle") == 1
    with broker.connect() as conn:
        send(conn, "idle", ["wake"])
    waiting.join()
    idle_conn.close()
    assert sample(text, "qmq_broker_backlog", subject="orders", group="g1") == 3
    assert sample(text, "qmq_broker_in_flight", subject="orders", group="g1") == 0
    assert sample(text, "qmq_broker_backlog", subject="orders", group="g2") == 0
    assert sample(text, "qmq_broker_in_flight", subject="orders", group="g2") == 5
    assert sample(text, "qmq_broker_dead", subject="orders", group="g2") == 0


def test_the_broker_exposes_only_its_own_metrics(processes, tmp_path) -> None:
    """A broker's /metrics must not carry the meta server's gauges: `qmq_meta_database_up 0` on every
    broker would page whoever alerts on the meta database being down."""
    metrics_port = free_port()
    broker = start_broker(processes, tmp_path / "b", "--metrics-port", str(metrics_port))
    wait_for_port(metrics_port, broker.proc)
    text = scrape(metrics_port)
    assert sample(text, "qmq_broker_read_only") == 0
    assert [line for line in text.splitlines() if line.startswith("qmq_meta_")] == []


# -- a clean restart -------------------------------------------------------------------------------------


def test_consumption_state_survives_a_clean_restart(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        c1 = RawConsumer(conn, "orders", "g", "c1", options={"start": "earliest"})
        other = RawConsumer(conn, "orders", "other", "x", options={"start": "earliest"})
        send(conn, "orders", [f"m{i}" for i in range(6)])
        got = c1.pull(max_count=6)
        assert [d.id for d in got] == [f"m{i}" for i in range(6)]
        c1.ack(got[:2])  # m0, m1 done; m2..m5 held by c1 when the broker stops
        assert len(other.drain(6)) == 6  # pulled and acked
        send(conn, "orders", ["m6"])

    assert processes.kill(broker.proc, signal.SIGTERM) == 0
    saved = snapshot.load(tmp_path / "b" / "consumers")  # fails the test if missing or damaged
    assert saved is not None
    groups = {(g["subject"], g["group"]): g for g in saved["groups"]}
    assert groups[("orders", "g")]["cursor"] == 6
    assert groups[("orders", "g")]["consumers"]["c1"][:2] == [6, 2]  # pull seq, ack seq

    broker = restart_broker(processes, broker)
    with broker.connect() as conn:
        stats = {g["group"]: g for g in conn.request(RequestCode.BROKER_STATS)["groups"]}
        assert (stats["g"]["backlog"], stats["g"]["in_flight"], stats["g"]["consumers"]) == (1, 4, 1)
        assert (stats["other"]["backlog"], stats["other"]["in_flight"]) == (1, 0)

        # A new consumer of the group gets only what nobody was handed: m2..m5 still belong to c1.
        c2 = RawConsumer(conn, "orders", "g", "c2")
        assert [d.id for d in c2.pull()] == ["m6"]

        # c1 comes back without `pulled` (a restarted client): its unacked messages come first, resent.
        reply = pull(conn, "orders", "g", "c1", max=64)
        assert [(b["subject"], b["first_pull"], b["resent"]) for b in reply["batches"]] == [("orders", 2, True)]
        assert ids(reply) == ["m2", "m3", "m4", "m5"]
        conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c1", 5]]})
        assert pull(conn, "orders", "g", "c1")["batches"] == []  # nothing acked comes back

        assert [d.id for d in RawConsumer(conn, "orders", "other", "x").pull()] == ["m6"]
    # The snapshot covered everything: nothing was replayed from the journal.
    assert ", 0 journal entries replayed" in log_text(broker.proc)  # logged before it listens


def test_a_pull_naming_sequences_never_handed_out_here_is_told_the_broker_is_behind(processes, tmp_path) -> None:
    """After a failover a consumer may name, in `pulled`, pull sequences its old master handed out
    that never reached the new one. The broker hands out nothing new to it (those numbers would mean
    other messages here, and the consumer's acks of them would cover messages it never saw): it
    answers at once with an empty `behind` batch at the end of its own pull log, and the consumer
    starts over from its acknowledged point."""
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        send(conn, "orders", ["m0", "m1", "m2"])
        reply = pull(conn, "orders", "g", "c1", start="earliest", max=64)
        assert ids(reply) == ["m0", "m1", "m2"]  # pull sequences 0..2
        conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c1", 0]]})
        send(conn, "orders", ["m3", "m4"])

        reply = pull(conn, "orders", "g", "c1", pulled={"orders": 4}, wait_ms=10_000)  # answered at once
        assert reply["batches"] == [
            {"subject": "orders", "group": "g", "first_pull": 3, "resent": False, "behind": True, "messages": []}
        ]
        with pytest.raises(RemoteError) as refused:  # nothing was numbered 3 or 4 meanwhile
            conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c1", 4]]})
        assert refused.value.code == ErrorCode.UNKNOWN_CONSUMER
        # A consumer this broker never saw, naming what it got elsewhere, is told the same.
        reply = pull(conn, "orders", "g", "c2", pulled={"orders": 1})
        assert [(b["first_pull"], b["behind"], b["messages"]) for b in reply["batches"]] == [(0, True, [])]

        # Starting over: what c1 holds unacknowledged comes first, then the new messages.
        reply = pull(conn, "orders", "g", "c1", max=64)
        assert [(b["first_pull"], b["resent"]) for b in reply["batches"]] == [(1, True)]
        assert ids(reply) == ["m1", "m2"]
        reply = pull(conn, "orders", "g", "c1", pulled={"orders": 2}, max=64)
        assert [(b["first_pull"], b["resent"]) for b in reply["batches"]] == [(3, False)]
        assert ids(reply) == ["m3", "m4"]


def test_a_rejected_pull_leaves_nothing_unjournalled_behind(processes, tmp_path) -> None:
    """A pull refused half-way (here: `pulled` names the subject with a string) must not change state it
    does not journal. The broker hands out the group's due retry first, then refuses the request on the
    subject's `pulled` value; the retry's hand-out stays in memory but not in the journal, so after a
    crash the journal's later ack of it cannot be replayed and the broker no longer starts."""
    broker = start_broker(processes, tmp_path / "b")
    with broker.connect() as conn:
        c1 = RawConsumer(conn, "orders", "g", "c1", options={"start": "earliest"})
        send(conn, "orders", ["m0"])
        (first,) = c1.pull()
        assert c1.nack(first, delay_ms=0)[0] == "retry"
        c1.ack([first])
        # The retry task appends the message to %RETRY%orders%g as soon as it is due (at once); it then
        # counts in the group's backlog, which STATS shows without handing anything out.
        wait_until(
            lambda: conn.request(RequestCode.BROKER_STATS)["groups"][0]["backlog"] == 1,
            "the retry to be appended to the retry subject",
        )
        with pytest.raises(RemoteError) as refused:
            pull(conn, "orders", "g", "c1", pulled={"orders": "x"})
        assert refused.value.code == ErrorCode.BAD_REQUEST
        assert "pulled" in refused.value.message
        reply = pull(conn, "orders", "g", "c1")
        assert [(b["subject"], b["first_pull"], ids({"batches": [b]})) for b in reply["batches"]] == [
            ("%RETRY%orders%g", 0, ["m0"])
        ]
        conn.request(RequestCode.BROKER_ACK, {"acks": [["%RETRY%orders%g", "g", "c1", 0]]})

    processes.kill(broker.proc)  # SIGKILL, before the periodic snapshot (every 10 s)
    try:
        broker = restart_broker(processes, broker)
    except RuntimeError:
        tail = log_text(processes.procs[-1]).strip().splitlines()[-1]
        pytest.fail(f"the broker does not start again after a crash: {tail}")
    with broker.connect() as conn:
        stats = conn.request(RequestCode.BROKER_STATS)["groups"]
        assert [(g["group"], g["backlog"], g["in_flight"]) for g in stats] == [("g", 0, 0)]
        assert pull(conn, "orders", "g", "c1")["batches"] == []
