"""Messages to send, as a user writes them and as a broker receives them, and what became of each.

A user's `OutgoingMessage` becomes a wire message once, with its id, so that a retry on another broker
group carries the same id and a consumer can drop the duplicate. The wire message is checked with
the broker's own check (`qmq.protocol.limits.validate_sent_message`): what a broker would refuse is
refused here, before sending, with the error code the broker would answer (`check_message`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from qmq.client.errors import ClientError, InvalidMessage
from qmq.compiled import load
from qmq.ids import new_id
from qmq.protocol import envelope
from qmq.protocol.errors import ProtocolError
from qmq.protocol.limits import (
    DEFAULT_LIMITS,
    MAX_KEY_LEN,
    MAX_MESSAGE_ID_LEN,
    ONCE_FIELD,
    validate_sent_message,
    validate_subject,
)
from qmq.protocol.ordering import ORDER_KEY_HEADER, queue_of, queue_subject


def now_ms() -> int:
    return time.time_ns() // 1_000_000


# Where `check_message` leaves a message's checked wire form, for its `to_wire` to hand out again.
CHECKED_WIRE = "_checked_wire"

# `to_wire` of the common message, compiled (qmq/client/_wire.pyx); None: the Python path for all.
compiled = load("qmq.client._wire")
# Subjects found valid by a `to_wire` given no set of its own (every send, and an outbox's check), so
# that each is checked once per process: the compiled path takes only subjects already checked.
# Forgotten when it grows this large.
CHECKED_SUBJECTS_KEPT = 4096
_checked_subjects: set[str] = set()


# A frozen dataclass's generated __init__ sets each field through object.__setattr__; the classes
# made once per message (these below, and `Delivery`) set their instance dict at once (`set_fields`).
_set_attr = object.__setattr__
_new_object = object.__new__


def set_fields(instance: object, fields: dict[str, Any]) -> None:
    """Give a frozen dataclass instance exactly `fields` (every one of its fields, by name)."""
    _set_attr(instance, "__dict__", fields)


@dataclass(frozen=True, init=False)
class OutgoingMessage:
    """A message to send. `body` is bytes, str or anything JSON can encode (see
    `qmq.protocol.envelope`); `id` is made now when not given, and stays the message's id through
    every retry; `created_at` is ms since the epoch, now when not given."""

    subject: str
    body: Any
    key: str | None = None
    tags: Sequence[str] = ()
    headers: Mapping[str, str] | None = None
    id: str = field(default_factory=new_id)
    created_at: int = field(default_factory=now_ms)
    # Given: `body` is already encoded bytes of this type (an outbox row); None: inferred from the body.
    content_type: str | None = None
    # When to deliver: an aware datetime, or ms since the epoch. In the future: the message goes to a
    # delay server, which hands it to a broker then; None or a time already past: straight to a broker.
    deliver_at: datetime | int | None = None
    # Ordered per key (docs/ordering.md): sent to the key's logical queue `subject#queue`, on the one
    # broker group that queue belongs to, never elsewhere; the key travels in a header.
    order_key: str | None = None

    def __init__(
        self,
        subject: str,
        body: Any,
        key: str | None = None,
        tags: Sequence[str] = (),
        headers: Mapping[str, str] | None = None,
        id: str | None = None,
        created_at: int | None = None,
        content_type: str | None = None,
        deliver_at: datetime | int | None = None,
        order_key: str | None = None,
    ) -> None:
        if deliver_at is not None:
            deliver_at = deliver_at_ms(deliver_at)
        if order_key is not None:
            check_order_key(order_key, deliver_at)
        set_fields(
            self,
            {
                "subject": subject,
                "body": body,
                "key": key,
                "tags": tags,
                "headers": headers,
                "id": new_id() if id is None else id,
                "created_at": now_ms() if created_at is None else created_at,
                "content_type": content_type,
                "deliver_at": deliver_at,
                "order_key": order_key,
            },
        )

    def to_wire(self, known_subjects: set[str] | None = None) -> dict[str, Any]:
        """`{"id", "subject", "payload", "key", "tags"}` as BROKER_SEND carries the message, its body
        wrapped in the envelope, checked as a broker checks it (see `check_message`); an empty key
        and empty tags are left out (`wire`).
        `known_subjects`: subjects already found valid, to skip (found valid here, they are added);
        None: this process's own set (`_checked_subjects`)."""
        fields = self.__dict__
        checked = fields.get(CHECKED_WIRE)
        if checked is not None:  # `check_message` built it already (an outbox's after-commit send)
            return dict(checked)
        if known_subjects is None:
            if len(_checked_subjects) >= CHECKED_SUBJECTS_KEPT:
                _checked_subjects.clear()
            known_subjects = _checked_subjects
        # Only for this class itself (a subclass may compute a field) and a plain set of subjects.
        if compiled is not None and type(self) is OutgoingMessage and type(known_subjects) is set:
            fast = compiled.plain_wire(
                fields, known_subjects, DEFAULT_LIMITS.max_message_bytes, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN
            )
            if fast is not None:
                return fast
        headers = dict(self.headers) if self.headers else None
        subject = self.subject
        if self.order_key is not None:
            headers = {**(headers or {}), ORDER_KEY_HEADER: self.order_key}
            try:
                validate_subject(subject)  # the subject itself, not one of its queues
            except ProtocolError as exc:
                raise InvalidMessage(exc.code, exc.message) from None
            subject = queue_subject(subject, queue_of(self.order_key))
        payload = envelope.encode(
            self.body,
            headers=headers,
            created_at=self.created_at,
            content_type=self.content_type,
        )
        return check_wire(wire(self.id, subject, payload, self.key, self.tags), known_subjects)


class ForwardedMessage(OutgoingMessage):
    """A message whose payload is already an envelope (the delay server handing on what a producer
    sent): sent as it is, with its id, marked `once`: a broker that already holds that id for the
    subject (a delivery fired again after a crash or a failover) does not store it twice."""

    def __init__(
        self,
        subject: str,
        body: Any = None,
        *,
        payload: bytes,
        key: str | None = None,
        tags: Sequence[str] = (),
        id: str,
    ) -> None:
        super().__init__(subject, body, key=key, tags=tuple(tags), id=id)
        object.__setattr__(self, "payload", payload)

    def to_wire(self, known_subjects: set[str] | None = None) -> dict[str, Any]:
        forwarded = wire(self.id, self.subject, self.payload, self.key, self.tags)
        forwarded[ONCE_FIELD] = True
        return check_wire(forwarded, known_subjects)


def check_message(message: OutgoingMessage) -> dict[str, Any]:
    """`message` as a send request carries it, refused exactly as a broker would refuse it: raises
    `InvalidMessage` whose `code` is the broker's answer (BAD_SUBJECT; BAD_REQUEST for the id, key
    or tags; MESSAGE_TOO_LARGE for a payload, envelope included, over `MAX_MESSAGE_BYTES`), or
    TypeError for a body that cannot be encoded. For code that keeps a message to send later (an
    outbox), so that a message no broker would ever take is refused in its caller. The message keeps
    what was built, so that sending it later does not encode and check it again."""
    wire = message.to_wire()
    message.__dict__[CHECKED_WIRE] = dict(wire)  # beside the frozen fields, as functools.cached_property does
    return wire


def check_order_key(order_key: object, deliver_at: object = None) -> str:
    """`order_key` if it can order messages: a non-empty string of at most MAX_KEY_LEN bytes, on a
    message that is not delayed (a delayed message would overtake or fall behind its key's others)."""
    if not isinstance(order_key, str) or not order_key or len(order_key.encode()) > MAX_KEY_LEN:
        raise ValueError(f"order_key must be a non-empty string of at most {MAX_KEY_LEN} bytes, not {order_key!r}")
    if deliver_at is not None:
        raise ValueError("an ordered message (order_key=) cannot be delayed: it would leave its key's order")
    return order_key


def deliver_at_ms(value: datetime | int) -> int:
    """A delivery time as ms since the epoch: from an aware datetime, or an int already in ms."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("deliver_at must be an aware datetime (with a tzinfo), or ms since the epoch")
        return int(value.timestamp() * 1000)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"deliver_at must be an aware datetime or ms since the epoch, not {type(value).__name__}")


def wire(message_id: str, subject: str, payload: bytes, key: str | None, tags: Sequence[str]) -> dict[str, Any]:
    """A message as BROKER_SEND carries it. An empty key and empty tags are left out (the broker
    stores none for either): two fields fewer to pack and unpack with every message."""
    out: dict[str, Any] = {"id": message_id, "subject": subject, "payload": payload}
    if key:
        out["key"] = key
    if tags:
        out["tags"] = list(tags)
    return out


def check_wire(wire: dict[str, Any], known_subjects: set[str] | None = None) -> dict[str, Any]:
    """`wire` if a broker would store it, else `InvalidMessage` with the broker's error code."""
    try:
        validate_sent_message(wire, DEFAULT_LIMITS, set() if known_subjects is None else known_subjects)
    except ProtocolError as exc:
        raise InvalidMessage(exc.code, exc.message) from None
    return wire


@dataclass(frozen=True, init=False)
class SendResult:
    """What became of one message: stored by `group`, or not (`error_code`, `error`)."""

    message_id: str
    subject: str
    ok: bool
    error_code: int | None = None
    error: str | None = None
    group: str | None = None

    def __init__(
        self,
        message_id: str,
        subject: str,
        ok: bool,
        error_code: int | None = None,
        error: str | None = None,
        group: str | None = None,
    ) -> None:
        set_fields(
            self,
            {
                "message_id": message_id,
                "subject": subject,
                "ok": ok,
                "error_code": error_code,
                "error": error,
                "group": group,
            },
        )

    @classmethod
    def stored(cls, message_id: str, subject: str, group: str) -> SendResult:
        """`SendResult(message_id, subject, True, group=group)`, made without the keyword parsing of
        `__init__`: one is made for every message a broker stores."""
        result = _new_object(cls)
        set_fields(
            result,
            {
                "message_id": message_id,
                "subject": subject,
                "ok": True,
                "error_code": None,
                "error": None,
                "group": group,
            },
        )
        return result


class SendError(ClientError):
    """A message was rejected, or no broker group accepted it. `result` says which and why."""

    def __init__(self, result: SendResult) -> None:
        super().__init__(f"message {result.message_id} to {result.subject} was not sent: {result.error}")
        self.result = result
