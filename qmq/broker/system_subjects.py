"""The broker's own subjects for one (subject, group): `%RETRY%subject%group` and `%DEAD%subject%group`,
and the records it writes there.

A retry or dead-letter record keeps the message's id, key and tags, and wraps its payload with what
the consumer needs to know: the attempt it will be, the original subject and store time, and the
reason of the last failure. Such records carry `WRAPPED` in the record flags. Nothing here does I/O.
"""

from __future__ import annotations

from typing import NamedTuple

import msgpack

from qmq.store.record import Record
from qmq.store.store import Message

WRAPPED = 0x01  # record flag: the payload is [attempt, subject, stored_at, payload, reason]
REDRIVEN_REASON = "re-driven"  # the reason of a dead letter's copy sent back to its group


def retry_subject(subject: str, group_key: str) -> str:
    return f"%RETRY%{subject}%{group_key}"


def dead_subject(subject: str, group_key: str) -> str:
    return f"%DEAD%{subject}%{group_key}"


def user_subject(stored: str) -> str:
    """The producer's subject behind a stored subject (`%RETRY%s%g` -> `s`)."""
    return stored[1:].split("%")[1] if stored.startswith("%") else stored


class Unwrapped(NamedTuple):
    attempt: int  # 1 for a first delivery
    subject: str  # the subject the producer sent to
    stored_at: int  # ms, when the producer's message was first stored
    payload: bytes
    reason: str


def unwrap(record: Record) -> Unwrapped:
    if record.flags & WRAPPED:
        attempt, subject, stored_at, payload, reason = msgpack.unpackb(record.payload, raw=False)
        return Unwrapped(attempt, subject, stored_at, payload, reason)
    return Unwrapped(1, record.subject, record.store_ts, record.payload, "")


def wrap(record: Record, to_subject: str, attempt: int, reason: str) -> Message:
    """A copy of `record` (plain or already wrapped) for a retry or dead-letter subject."""
    original = unwrap(record)
    payload = msgpack.packb(
        [attempt, original.subject, original.stored_at, original.payload, reason], use_bin_type=True
    )
    return Message(to_subject, record.message_id, payload, record.key, record.tags, WRAPPED)


def delivery(record: Record) -> dict:
    """A record as a pull reply carries it (docs/broker.md)."""
    if not record.flags & WRAPPED:  # the common case, kept cheap: one dict per message on the hot path
        return {
            "id": record.message_id,
            "subject": record.subject,
            "payload": record.payload,
            "key": record.key,
            "tags": list(record.tags),
            "attempt": 1,
            "stored_at": record.store_ts,
        }
    original = unwrap(record)
    return {
        "id": record.message_id,
        "subject": original.subject,
        "payload": original.payload,
        "key": record.key,
        "tags": list(record.tags),
        "attempt": original.attempt,
        "stored_at": original.stored_at,
    }
