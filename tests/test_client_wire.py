"""The compiled `to_wire` (qmq/client/_wire.pyx): for every message it takes, the same wire map and
envelope bytes as the Python path; everything else it leaves to the Python path, which refuses
what a broker would refuse."""

from __future__ import annotations

import msgpack
import pytest

from qmq.client import messages
from qmq.client.errors import InvalidMessage
from qmq.client.messages import OutgoingMessage, check_message
from qmq.protocol import envelope
from qmq.protocol.errors import ErrorCode
from qmq.protocol.limits import DEFAULT_LIMITS, MAX_KEY_LEN, MAX_MESSAGE_ID_LEN

SUBJECT = "orders.created"


def python_wire(message: OutgoingMessage, monkeypatch: pytest.MonkeyPatch, subject: str = SUBJECT) -> dict:
    with monkeypatch.context() as patch:
        patch.setattr(messages, "compiled", None)
        return message.to_wire({subject})


def compiled_wire(message: OutgoingMessage) -> dict | None:
    return messages.compiled.plain_wire(
        message.__dict__, {SUBJECT}, DEFAULT_LIMITS.max_message_bytes, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN
    )


def test_the_compiled_wire_is_built_and_used() -> None:
    assert messages.compiled is not None  # scripts/setup.sh builds it


SIZES = [0, 1, 31, 32, 255, 256, 65535, 65536, 70000]
TIMES = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 1_764_000_000_000, 2**64 - 1]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("created_at", [*TIMES[::3], TIMES[-2]])
def test_bytes_bodies_are_encoded_byte_for_byte_as_the_python_path(
    size: int, created_at: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    message = OutgoingMessage(SUBJECT, bytes(range(256)) * (size // 256) + b"x" * (size % 256), created_at=created_at)
    wire = compiled_wire(message)
    assert wire == python_wire(message, monkeypatch)
    assert list(wire) == ["id", "subject", "payload"]
    assert envelope.decode(wire["payload"]).body == message.body


@pytest.mark.parametrize("created_at", TIMES)
def test_every_width_of_the_creation_time(created_at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    message = OutgoingMessage(SUBJECT, b"body", created_at=created_at)
    assert compiled_wire(message) == python_wire(message, monkeypatch)
    assert envelope.decode(compiled_wire(message)["payload"]).created_at == created_at


@pytest.mark.parametrize(
    "fields",
    [
        {"key": "customer-7"},
        {"key": "ключ" * 32},  # 128 characters, 256 bytes of UTF-8: the longest key
        {"key": "ключ" * 60},  # 480 bytes: refused, so left to the Python path
        {"key": ""},
        {"headers": {"qmq-producer": "outbox:shop", "trace": "é" * 40}},
        {"headers": {"h" * 300: "v" * 70000}},
        {"headers": {}},
        {"content_type": "application/json", "body": b'{"id": 7}'},
        {"content_type": "text/plain; charset=utf-8" + " " * 300, "body": b"hello"},
        {"id": "x" * MAX_MESSAGE_ID_LEN},
    ],
)
def test_keys_headers_content_types_and_ids_as_the_python_path(fields: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    message = OutgoingMessage(**{"subject": SUBJECT, "body": b"payload", **fields})
    try:
        expected = python_wire(message, monkeypatch)
    except InvalidMessage:
        assert compiled_wire(message) is None  # the broker would refuse it: left to the Python path
        return
    assert compiled_wire(message) == expected
    if fields.get("headers"):
        assert envelope.decode(expected["payload"]).headers == fields["headers"]


@pytest.mark.parametrize(
    "message",
    [
        OutgoingMessage("not.checked.yet", b"x"),  # a subject not yet found valid in this send
        OutgoingMessage(SUBJECT, "text"),  # bodies other than bytes are encoded in Python
        OutgoingMessage(SUBJECT, {"id": 7}),
        OutgoingMessage(SUBJECT, bytearray(b"x")),
        OutgoingMessage(SUBJECT, b"x", tags=("a",)),
        OutgoingMessage(SUBJECT, b"x", order_key="k"),
        OutgoingMessage(SUBJECT, b"x", headers={"n": 1}),  # str() of a value is the Python path's
        OutgoingMessage(SUBJECT, b"x", headers={f"h{i}": "v" for i in range(16)}),
        OutgoingMessage(SUBJECT, b"x", key=7),  # type: ignore[arg-type]
        OutgoingMessage(SUBJECT, b"x", created_at=-1),
        OutgoingMessage(SUBJECT, b"x", created_at=2**64),
        OutgoingMessage(SUBJECT, b"x", id="x" * (MAX_MESSAGE_ID_LEN + 1)),
        OutgoingMessage(SUBJECT, b"x", id="é" * 33),  # 33 characters, 66 bytes
        OutgoingMessage(SUBJECT, b"x", id=""),
        OutgoingMessage(SUBJECT, b"x", key="k" * (MAX_KEY_LEN + 1)),
        OutgoingMessage(SUBJECT, b"x", key="\ud800"),  # no UTF-8 for a lone surrogate
        OutgoingMessage(SUBJECT, b"x" * DEFAULT_LIMITS.max_message_bytes),  # too large with its envelope
    ],
    ids=lambda m: repr(m)[:60],
)
def test_the_rest_is_left_to_the_python_path(message: OutgoingMessage) -> None:
    assert compiled_wire(message) is None


class LooksEmpty:
    """Equal to "" and yet true: the compiled path must look at a key's type before comparing it."""

    def __eq__(self, other: object) -> bool:
        return other == ""

    def __ne__(self, other: object) -> bool:
        return other != ""

    __hash__ = object.__hash__


class Shouting(OutgoingMessage):
    """A subclass that computes a field: to_wire must read the attribute, as the Python path does."""

    @property
    def body(self) -> bytes:  # type: ignore[override]
        return self.__dict__["body"].upper()


class SubjectSet(set):
    pass


def test_keys_subclasses_and_sets_the_compiled_path_must_not_take() -> None:
    with pytest.raises(InvalidMessage) as raised:
        OutgoingMessage(SUBJECT, b"x", key=LooksEmpty()).to_wire({SUBJECT})  # type: ignore[arg-type]
    assert raised.value.code == ErrorCode.BAD_REQUEST
    assert envelope.decode(Shouting(SUBJECT, b"abc").to_wire({SUBJECT})["payload"]).body == b"ABC"
    wire = OutgoingMessage(SUBJECT, b"x").to_wire(SubjectSet({SUBJECT}))
    assert envelope.decode(wire["payload"]).body == b"x"


def test_what_a_broker_refuses_is_still_refused_with_its_code() -> None:
    too_large = OutgoingMessage(SUBJECT, b"x" * DEFAULT_LIMITS.max_message_bytes)
    with pytest.raises(InvalidMessage) as raised:
        too_large.to_wire({SUBJECT})
    assert raised.value.code == ErrorCode.MESSAGE_TOO_LARGE
    with pytest.raises(InvalidMessage) as raised:
        OutgoingMessage(SUBJECT, b"x", id="x" * (MAX_MESSAGE_ID_LEN + 1)).to_wire({SUBJECT})
    assert raised.value.code == ErrorCode.BAD_REQUEST
    with pytest.raises(InvalidMessage) as raised:
        OutgoingMessage("bad subject!", b"x").to_wire()
    assert raised.value.code == ErrorCode.BAD_SUBJECT


def test_a_message_checked_alone_takes_the_compiled_path_once_its_subject_was_seen(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`check_message` (an outbox) passes no set of subjects: the subjects it found valid are kept."""
    first = OutgoingMessage("outbox.subject", b"a", headers={"qmq-producer": "outbox:db"})
    check_message(first)
    second = OutgoingMessage("outbox.subject", b"b", headers={"qmq-producer": "outbox:db"})
    assert messages.compiled.plain_wire(
        second.__dict__, messages._checked_subjects, DEFAULT_LIMITS.max_message_bytes, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN
    ) == python_wire(second, monkeypatch, "outbox.subject")
    assert msgpack.unpackb(check_message(second)["payload"])["h"] == {"qmq-producer": "outbox:db"}
