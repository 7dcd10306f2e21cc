"""Named limits shared by the wire protocol and the store, with their defaults.

A subject is what producers send to and consumers subscribe to. System subjects made by qmq itself
(`%RETRY%subject%group`, `%DEAD%subject%group`, the broker's `%ACTION%` journal) contain `%`, which
users may not use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, NamedTuple

from qmq.protocol.errors import ErrorCode, ProtocolError

MAX_FRAME_BYTES = 16 * 1024 * 1024  # a whole frame, header included
# Before its handshake is accepted a peer is nobody: a server reads at most this much of a frame from
# it, so an unauthenticated client cannot make it buffer (or log) megabytes.
MAX_HANDSHAKE_FRAME_BYTES = 4096
MAX_BODY_DEPTH = 32  # nesting of maps and lists in a body; real bodies need fewer than 8
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # one message body (RocketMQ's default)
MAX_SUBJECT_LEN = 200  # characters
MAX_TAG_LEN = 64
MAX_TAGS = 16
MAX_KEY_LEN = 256
MAX_MESSAGE_ID_LEN = 64
MAX_GROUP_LEN = 64  # consumer groups and broker groups (a retry subject holds subject and group)
MAX_CONSUMER_LEN = 200  # a consumer id
MAX_PULL_MESSAGES = 4096  # messages in one pull reply
MAX_PULL_WAIT_MS = 30_000  # how long one long-polling pull may wait

SUBJECT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")
SYSTEM_SUBJECT_RE = re.compile(r"%(RETRY|DEAD)%[A-Za-z0-9._\-]+(#[0-9]{1,4})?%[A-Za-z0-9._\-]+|%ACTION%")
# One logical queue of an ordered subject, `subject#queue` (qmq/protocol/ordering.py).
QUEUE_SUBJECT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*#(?:[0-9]|[1-5][0-9]|6[0-3])")
ACTION_SUBJECT = "%ACTION%"  # the broker's action journal (qmq/broker/journal.py)
GROUP_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*")  # broker groups and consumer groups
TAG_RE = re.compile(r"[A-Za-z0-9._\-:]+")
CONSUMER_RE = re.compile(r"[A-Za-z0-9._\-:@]+")
CONSUMER_BAD_CHAR_RE = re.compile(r"[^A-Za-z0-9._\-:@]")  # to make a valid consumer id from a host name


@dataclass(frozen=True)
class Limits:
    """Per-server limits; tests and operators may lower or raise them."""

    max_frame_bytes: int = MAX_FRAME_BYTES
    max_message_bytes: int = MAX_MESSAGE_BYTES
    max_subject_len: int = MAX_SUBJECT_LEN
    max_handshake_frame_bytes: int = MAX_HANDSHAKE_FRAME_BYTES
    max_body_depth: int = MAX_BODY_DEPTH


DEFAULT_LIMITS = Limits()


def validate_subject(subject: object, *, allow_system: bool = False, limits: Limits = DEFAULT_LIMITS) -> str:
    """Return `subject` if it is a valid subject name, else raise a non-fatal `ProtocolError`."""
    if not isinstance(subject, str) or not subject:
        raise ProtocolError(ErrorCode.BAD_SUBJECT, "subject must be a non-empty string", fatal=False)
    if len(subject) > limits.max_subject_len:
        raise ProtocolError(
            ErrorCode.BAD_SUBJECT,
            f"subject is {len(subject)} characters, the limit is {limits.max_subject_len}",
            fatal=False,
        )
    if (
        SUBJECT_RE.fullmatch(subject)
        or QUEUE_SUBJECT_RE.fullmatch(subject)
        or (allow_system and SYSTEM_SUBJECT_RE.fullmatch(subject))
    ):
        return subject
    raise ProtocolError(
        ErrorCode.BAD_SUBJECT,
        f"subject {subject!r} may only contain letters, digits, '.', '_' and '-', starting with a letter or digit",
        fatal=False,
    )


# A replicated delay-server group NAME is `delay:NAME` where replicated groups are listed (META_LIST's
# `replication`, REPL_SWITCH), apart from broker groups (docs/replication.md).
DELAY_GROUP_PREFIX = "delay:"


def validate_group(group: object, what: str = "group") -> str:
    """Return `group` if it is a valid consumer-group or broker-group name, else raise a non-fatal
    BAD_REQUEST `ProtocolError`."""
    if not isinstance(group, str) or len(group) > MAX_GROUP_LEN or not GROUP_RE.fullmatch(group):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"{what} {group!r} must be 1-{MAX_GROUP_LEN} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
            fatal=False,
        )
    return group


def validate_consumer(consumer: object) -> str:
    """Return `consumer` if it is a valid consumer id, else raise a non-fatal BAD_REQUEST `ProtocolError`."""
    if not isinstance(consumer, str) or len(consumer) > MAX_CONSUMER_LEN or not CONSUMER_RE.fullmatch(consumer):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"consumer {consumer!r} must be 1-{MAX_CONSUMER_LEN} letters, digits, '.', '_', '-', ':' or '@'",
            fatal=False,
        )
    return consumer


def consumer_id_from(text: str) -> str:
    """A valid consumer id made from any text (a host name, a template), keeping its end."""
    return CONSUMER_BAD_CHAR_RE.sub("-", text)[-MAX_CONSUMER_LEN:] or "qmq"


def validate_tags(tags: object) -> tuple[str, ...]:
    """Return the tags as a tuple if every one is valid, else raise a non-fatal `ProtocolError`."""
    if not isinstance(tags, (list, tuple)):
        raise ProtocolError(ErrorCode.BAD_REQUEST, "tags must be a list of strings", fatal=False)
    if len(tags) > MAX_TAGS:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"{len(tags)} tags, the limit is {MAX_TAGS}", fatal=False)
    for tag in tags:
        if not isinstance(tag, str) or len(tag) > MAX_TAG_LEN or not TAG_RE.fullmatch(tag):
            raise ProtocolError(
                ErrorCode.BAD_REQUEST,
                f"tag {tag!r} must be 1-{MAX_TAG_LEN} of letters, digits, '.', '_', '-', ':'",
                fatal=False,
            )
    return tuple(tags)


def validate_message_size(size: int, limits: Limits = DEFAULT_LIMITS) -> None:
    if size > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"message body is {size} bytes, the limit is {limits.max_message_bytes}",
            fatal=False,
        )


_new_tuple = tuple.__new__


class SentMessage(NamedTuple):
    """One message of a send request (BROKER_SEND, DELAY_SEND), checked."""

    subject: str
    id: str
    payload: bytes
    key: str | None
    tags: tuple[str, ...]


# A sent message's field: store it only if this broker does not hold its id for the subject already
# (a delay server's delivery fired again; qmq/broker/dedupe.py).
ONCE_FIELD = "once"


def validate_sent_message(item: Any, limits: Limits, known_subjects: set[str]) -> SentMessage:
    """`item` checked as a message of a send request, or a non-fatal `ProtocolError` saying why not.
    Subjects found valid are added to `known_subjects`, so each is checked once. The servers' hot path:
    plain type checks first."""
    if type(item) is not dict:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "a message must be a map", fatal=False)
    subject = item.get("subject")
    if type(subject) is not str or subject not in known_subjects:
        validate_subject(subject, limits=limits)
        known_subjects.add(subject)
    message_id = item.get("id")
    if (
        type(message_id) is not str
        or not 0 < len(message_id) <= MAX_MESSAGE_ID_LEN
        or (len(message_id) > MAX_MESSAGE_ID_LEN // 4 and len(message_id.encode()) > MAX_MESSAGE_ID_LEN)
    ):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST, f"message id must be a string of 1-{MAX_MESSAGE_ID_LEN} bytes", fatal=False
        )
    payload = item.get("payload")
    if type(payload) is not bytes:
        raise ProtocolError(ErrorCode.BAD_REQUEST, f"message {message_id}: payload must be bytes", fatal=False)
    if len(payload) > limits.max_message_bytes:
        raise ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"message {message_id} is {len(payload)} bytes, the limit is {limits.max_message_bytes}",
            fatal=False,
        )
    key = item.get("key")
    if key is not None and (type(key) is not str or len(key.encode()) > MAX_KEY_LEN):
        raise ProtocolError(
            ErrorCode.BAD_REQUEST,
            f"message {message_id}: key must be a string of at most {MAX_KEY_LEN} bytes",
            fatal=False,
        )
    tags = item.get("tags")
    checked = (subject, message_id, payload, key or None, validate_tags(tags) if tags else ())
    return _new_tuple(SentMessage, checked)  # SentMessage(...) runs a Python __new__: per message sent
