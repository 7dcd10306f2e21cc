"""The compiled check of a BROKER_SEND (qmq/broker/_sending.pyx): for a request it takes, the same
store messages as the broker's message-by-message check; every other request is left to that check,
which names the bad message and its error."""

from __future__ import annotations

import dataclasses

import pytest

from qmq.broker import sending
from qmq.protocol.limits import DEFAULT_LIMITS, MAX_KEY_LEN, MAX_MESSAGE_ID_LEN, validate_sent_message
from qmq.store.store import Message

SUBJECT = "orders.created"
LIMIT = 1024


def compiled_batch(items: list) -> list[Message] | None:
    return sending.compiled.plain_batch(items, {SUBJECT}, LIMIT, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN, Message)


def checked_one_by_one(items: list) -> list[Message]:
    limits = dataclasses.replace(DEFAULT_LIMITS, max_message_bytes=LIMIT)
    out = []
    for item in items:
        m = validate_sent_message(item, limits, {SUBJECT})
        out.append(Message(m.subject, m.id, m.payload, m.key, m.tags, 0))
    return out


def test_the_compiled_check_is_built_and_used() -> None:
    assert sending.compiled is not None  # scripts/setup.sh builds it


@pytest.mark.parametrize(
    "items",
    [
        [],
        [{"id": "a", "subject": SUBJECT, "payload": b""}],
        [{"id": "x" * MAX_MESSAGE_ID_LEN, "subject": SUBJECT, "payload": b"p" * LIMIT}],
        [{"id": "é" * 32, "subject": SUBJECT, "payload": b"p", "key": "k" * MAX_KEY_LEN}],
        [{"id": "b", "subject": SUBJECT, "payload": b"p", "key": ""}, {"id": "c", "subject": SUBJECT, "payload": b"q"}],
        [{"id": "d", "subject": SUBJECT, "payload": b"p", "tags": []}],
        [{"id": f"m{i}", "subject": SUBJECT, "payload": bytes([i])} for i in range(64)],
    ],
)
def test_a_plain_request_gives_the_same_messages(items: list) -> None:
    batch = compiled_batch(items)
    assert batch == checked_one_by_one(items)
    assert all(type(m) is Message for m in batch)


@pytest.mark.parametrize(
    "bad",
    [
        "not a map",
        {"id": "a", "subject": "unchecked.subject", "payload": b"p"},  # checked (and kept) by the Python loop
        {"id": "a", "subject": SUBJECT, "payload": "text"},
        {"id": "a", "subject": SUBJECT, "payload": b"p" * (LIMIT + 1)},
        {"id": "", "subject": SUBJECT, "payload": b"p"},
        {"id": "x" * (MAX_MESSAGE_ID_LEN + 1), "subject": SUBJECT, "payload": b"p"},
        {"id": "é" * 33, "subject": SUBJECT, "payload": b"p"},
        {"id": 7, "subject": SUBJECT, "payload": b"p"},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "key": 7},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "key": "k" * (MAX_KEY_LEN + 1)},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "key": "\ud800"},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "tags": ["t"]},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "once": True},
        {"id": "a", "subject": SUBJECT, "payload": b"p", "other": 1},
    ],
    ids=repr,
)
def test_any_other_request_is_left_to_the_message_by_message_check(bad: object) -> None:
    good = {"id": "g", "subject": SUBJECT, "payload": b"p"}
    assert compiled_batch([good, bad, good]) is None
