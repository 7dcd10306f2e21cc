"""The client refuses, before sending, exactly what a broker refuses, with the broker's error code.

Each case is tried twice: through the client, pointed at an address where nothing listens (so a
refusal that had reached for the network would say UNAVAILABLE, or would not happen at all), and raw
over the wire to a real `qmq broker` process, as the client would have sent it. Both must name the
same `ErrorCode`. The values at the limit pass both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from qmq.client import Client, InvalidMessage, InvalidSubscription, OutgoingMessage, check_message
from qmq.net.client import BlockingConnection
from qmq.protocol import envelope
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.limits import MAX_CONSUMER_LEN, MAX_GROUP_LEN, MAX_MESSAGE_BYTES, MAX_TAGS
from tests.support.broker import HOST, Broker, start_broker
from tests.support.processes import ProcessManager, free_port

CREATED_AT = 1_700_000_000_000


@pytest.fixture(scope="module")
def broker(tmp_path_factory):
    manager = ProcessManager(tmp_path_factory.mktemp("client-limits"))
    try:
        yield start_broker(manager, tmp_path_factory.mktemp("data"))
    finally:
        manager.stop_all()


@pytest.fixture(scope="module")
def raw(broker: Broker):
    with broker.connect(client_id="limits-raw") as conn:
        yield conn


@pytest.fixture(scope="module")
def nowhere():
    """A client whose only broker address has nothing listening."""
    with Client(brokers=[f"{HOST}:{free_port()}"], client_id="limits-nowhere") as client:
        yield client


def body_for_payload(size: int) -> bytes:
    """A bytes body whose envelope (what a broker counts) is exactly `size` bytes."""
    overhead = len(envelope.encode(bytes(100_000), created_at=CREATED_AT)) - 100_000
    return bytes(size - overhead)


def unchecked_wire(message: OutgoingMessage) -> dict[str, Any]:
    """What a client that did not check would send for `message`."""
    payload = envelope.encode(message.body, created_at=message.created_at)
    return {
        "id": message.id,
        "subject": message.subject,
        "payload": payload,
        "key": message.key,
        "tags": list(message.tags),
    }


def broker_answer_to_send(raw: BlockingConnection, message: OutgoingMessage) -> int | None:
    """The broker's error code for `message` sent over the wire, or None when it stored it."""
    reply = raw.request(RequestCode.BROKER_SEND, {"messages": [unchecked_wire(message)]})
    return reply["rejected"][0][1] if reply["rejected"] else None


MESSAGES: dict[str, tuple[Callable[[], OutgoingMessage], ErrorCode]] = {
    "payload-4MiB+1": (
        lambda: OutgoingMessage("limits", body_for_payload(MAX_MESSAGE_BYTES + 1), created_at=CREATED_AT),
        ErrorCode.MESSAGE_TOO_LARGE,
    ),
    "subject": (lambda: OutgoingMessage("no spaces", "x"), ErrorCode.BAD_SUBJECT),
    "system-subject": (lambda: OutgoingMessage("%DEAD%limits%g", "x"), ErrorCode.BAD_SUBJECT),
    "key-257-bytes": (lambda: OutgoingMessage("limits", "x", key="k" * 257), ErrorCode.BAD_REQUEST),
    "tag": (lambda: OutgoingMessage("limits", "x", tags=["a b"]), ErrorCode.BAD_REQUEST),
    "too-many-tags": (
        lambda: OutgoingMessage("limits", "x", tags=[f"t{i}" for i in range(MAX_TAGS + 1)]),
        ErrorCode.BAD_REQUEST,
    ),
    "id-65-bytes": (lambda: OutgoingMessage("limits", "x", id="i" * 65), ErrorCode.BAD_REQUEST),
}


@pytest.mark.parametrize("case", list(MESSAGES))
def test_a_message_a_broker_refuses_is_refused_before_sending(case: str, raw, nowhere) -> None:
    make, code = MESSAGES[case]
    message = make()
    assert broker_answer_to_send(raw, message) == code
    with pytest.raises(InvalidMessage) as info:
        check_message(message)
    assert info.value.code == code
    [result] = nowhere.send([message])
    assert not result.ok and result.error_code == code, result.error


def at_the_limits(id_char: str) -> list[OutgoingMessage]:
    return [
        OutgoingMessage("limits", body_for_payload(MAX_MESSAGE_BYTES), created_at=CREATED_AT),
        OutgoingMessage("limits", "x", key="k" * 256, tags=[f"t{i}" for i in range(MAX_TAGS)], id=id_char * 64),
    ]


def test_a_message_at_the_limits_is_sent(broker: Broker, raw) -> None:
    assert all(broker_answer_to_send(raw, message) is None for message in at_the_limits("r"))
    messages = at_the_limits("c")
    assert len(check_message(messages[0])["payload"]) == MAX_MESSAGE_BYTES
    with Client(brokers=[broker.address]) as client:
        results = client.send(messages)
    assert all(r.ok for r in results), [r.error for r in results]


def broker_answer_to_pull(raw: BlockingConnection, **fields: Any) -> int | None:
    """The broker's error code for a pull with `fields`, or None when it served it."""
    body = {"subject": "limits", "group": "g", "consumer": "c", "wait_ms": 0, **fields}
    try:
        raw.request(RequestCode.BROKER_PULL, body)
    except RemoteError as exc:
        return exc.code
    return None


SUBSCRIPTIONS: dict[str, tuple[dict[str, Any], ErrorCode]] = {
    "group-65": ({"group": "g" * (MAX_GROUP_LEN + 1)}, ErrorCode.BAD_REQUEST),
    "group-chars": ({"group": "bad group"}, ErrorCode.BAD_REQUEST),
    "consumer-201": ({"consumer": "c" * (MAX_CONSUMER_LEN + 1)}, ErrorCode.BAD_REQUEST),
    "consumer-chars": ({"consumer": "a b"}, ErrorCode.BAD_REQUEST),
    "subject": ({"subject": "%RETRY%limits%g"}, ErrorCode.BAD_SUBJECT),
    "tag": ({"tags": ["a b"]}, ErrorCode.BAD_REQUEST),
    "start": ({"start": "middle"}, ErrorCode.BAD_REQUEST),
}


@pytest.mark.parametrize("case", list(SUBSCRIPTIONS))
def test_a_subscription_a_broker_refuses_is_refused_before_pulling(case: str, raw, nowhere) -> None:
    fields, code = SUBSCRIPTIONS[case]
    assert broker_answer_to_pull(raw, **fields) == code
    options = {"subject": "limits", "group": "g", "consumer": "c", **fields}
    with pytest.raises(InvalidSubscription) as info:  # without the check it would subscribe: nothing listens
        nowhere.subscribe(options.pop("subject"), options.pop("group"), **options)
    assert info.value.code == code and isinstance(info.value, ValueError)


def test_a_subscription_at_the_limits_is_served(broker: Broker, raw) -> None:
    group, consumer = "g" * MAX_GROUP_LEN, "c" * MAX_CONSUMER_LEN
    assert broker_answer_to_pull(raw, group=group, consumer=consumer) is None
    with Client(brokers=[broker.address]) as client:
        subscription = client.subscribe("limits.edge", group, consumer=consumer)
        sent = client.send_one("limits.edge", "x")
        [delivery] = subscription.pull(wait_s=10)
        assert delivery.id == sent.message_id
