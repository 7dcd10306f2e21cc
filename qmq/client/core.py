"""The client's decisions, without I/O, shared by the blocking and the asyncio client.

Sending: a user's message becomes a wire message once, with its id (so a retry on another broker
group carries the same id and a consumer can drop the duplicate); a `SendJob` spreads one send call
over the writable groups of each subject's route, batches it, merges the broker's per-message replies
into `SendResult`s and says which messages to try again, and where.

Consuming: a `SubscriptionState` builds pull requests, turns pull replies into `Delivery` objects and
keeps one `AckTracker` per (broker, stored subject, group key, consumer). The broker's acks are
prefixes (docs/broker.md): the tracker collects completions in any order and releases the contiguous
completed prefix as one ack entry. A tracker that lost touch with its broker is dropped: the broker
resends whatever it had not seen acknowledged, so nothing is lost, at the price of a duplicate.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import time
import zlib
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from qmq.client.routes import Route, RouteGroup
from qmq.ids import new_id
from qmq.protocol import envelope
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.limits import (
    GROUP_RE,
    MAX_FRAME_BYTES,
    MAX_KEY_LEN,
    MAX_MESSAGE_ID_LEN,
    validate_subject,
    validate_tags,
)

# Sending
DEFAULT_BATCH_SIZE = 64  # messages in one BROKER_SEND
MAX_BATCH_BYTES = MAX_FRAME_BYTES // 2  # payload bytes in one BROKER_SEND, well under a frame
MAX_PAYLOAD_BYTES = MAX_FRAME_BYTES - 64 * 1024  # a payload this large could never fit in a frame
SEND_ATTEMPTS = 3  # groups a message is offered to before its send is reported as failed
RETRY_DELAY_S = 0.2  # before offering a message again to a group that already failed it
SUSPECT_FOR_S = 5.0  # a group that just failed a send is chosen last for this long
SEND_TIMEOUT_S = 10.0  # wait for one BROKER_SEND reply
# A send that failed with one of these may work on another group (or later); any other is final.
RETRIABLE_SEND_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.READ_ONLY, ErrorCode.TIMEOUT})

# Consuming
DEFAULT_PULL_MAX = 64  # messages asked for in one pull
DEFAULT_PULL_WAIT_S = 2.5  # long polling: how long a pull waits for a message
MAX_PULL_WAIT_S = 30.0  # the broker's limit
PULL_REPLY_GRACE_S = 5.0  # a pull's reply may arrive this long after its wait before it is a timeout
PULL_RETRY_DELAY_S = 0.5  # after a broker failed a pull twice in a row, then doubling...
PULL_RETRY_MAX_DELAY_S = 5.0  # ...up to this
ACK_FLUSH_INTERVAL_S = 1.0  # acknowledgements wait at most this long (while pull or ack is called)
ACK_TIMEOUT_S = 10.0  # wait for a BROKER_ACK, BROKER_NACK or BROKER_HEARTBEAT reply
STARTS = ("latest", "earliest")
CONSUMER_RE = re.compile(r"[A-Za-z0-9._\-:@]{1,200}")
MAX_GROUP_LEN = 200
# A pull refused with one of these will be refused again: the subscription itself is wrong.
FATAL_PULL_CODES = frozenset(
    {
        ErrorCode.BAD_REQUEST,
        ErrorCode.BAD_SUBJECT,
        ErrorCode.BAD_BODY,
        ErrorCode.UNAUTHORIZED,
        ErrorCode.UNKNOWN_REQUEST,
        ErrorCode.UNSUPPORTED_VERSION,
    }
)


# ---- errors ----------------------------------------------------------------------------------------


class ClientError(Exception):
    """A problem a qmq client cannot work around, said so that the user can act on it."""


class MetaUnreachable(ClientError):
    """The meta server could not be asked for a route."""


class NoRoute(ClientError):
    """No broker group carries the subject (none registered, or every one is unavailable)."""


class SendError(ClientError):
    """A message was rejected, or no broker group accepted it. `result` says which and why."""

    def __init__(self, result: SendResult) -> None:
        super().__init__(f"message {result.message_id} to {result.subject} was not sent: {result.error}")
        self.result = result


def error_name(code: int | None) -> str:
    if code is None:
        return "ERROR"
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"


# ---- messages to send ------------------------------------------------------------------------------


class InvalidMessage(ValueError):
    """A message no broker would accept; `code` is the error a broker would answer with."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
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
    created_at: int = field(default_factory=lambda: time.time_ns() // 1_000_000)
    # Given: `body` is already encoded bytes of this type (an outbox row); None: inferred from the body.
    content_type: str | None = None
    # When to deliver: an aware datetime, or ms since the epoch. In the future: the message goes to a
    # delay server, which hands it to a broker then; None or a time already past: straight to a broker.
    deliver_at: datetime | int | None = None

    def __post_init__(self) -> None:
        if self.deliver_at is not None:
            object.__setattr__(self, "deliver_at", deliver_at_ms(self.deliver_at))

    def to_wire(self) -> dict[str, Any]:
        """The message as BROKER_SEND carries it, its body wrapped in the envelope. Raises
        `InvalidMessage` for what a broker would reject, and TypeError for a body that cannot be
        encoded."""
        return wire_message(
            self.subject,
            self.body,
            key=self.key,
            tags=self.tags,
            headers=self.headers,
            message_id=self.id,
            created_at=self.created_at,
            content_type=self.content_type,
        )


class ForwardedMessage(OutgoingMessage):
    """A message whose payload is already an envelope (the delay server handing on what a producer
    sent): sent as it is, with its id."""

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

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "subject": self.subject,
            "payload": self.payload,
            "key": self.key,
            "tags": list(self.tags),
        }


def deliver_at_ms(value: datetime | int) -> int:
    """A delivery time as ms since the epoch: from an aware datetime, or an int already in ms."""
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise ValueError("deliver_at must be an aware datetime (with a tzinfo), or ms since the epoch")
        return int(value.timestamp() * 1000)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    raise TypeError(f"deliver_at must be an aware datetime or ms since the epoch, not {type(value).__name__}")


def wire_message(
    subject: str,
    body: Any,
    *,
    key: str | None = None,
    tags: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
    message_id: str | None = None,
    created_at: int | None = None,
    content_type: str | None = None,
) -> dict[str, Any]:
    """`{"id", "subject", "payload", "key", "tags"}` for BROKER_SEND; see `OutgoingMessage.to_wire`."""
    message_id = message_id or new_id()
    try:
        validate_subject(subject)
        tags = validate_tags(list(tags))
    except ProtocolError as exc:
        raise InvalidMessage(exc.code, exc.message) from None
    if not isinstance(message_id, str) or not 0 < len(message_id.encode()) <= MAX_MESSAGE_ID_LEN:
        raise InvalidMessage(ErrorCode.BAD_REQUEST, f"message id must be a string of 1-{MAX_MESSAGE_ID_LEN} bytes")
    if key is not None and (not isinstance(key, str) or len(key.encode()) > MAX_KEY_LEN):
        raise InvalidMessage(ErrorCode.BAD_REQUEST, f"key must be a string of at most {MAX_KEY_LEN} bytes")
    if created_at is None:
        created_at = time.time_ns() // 1_000_000
    payload = envelope.encode(
        body, headers=dict(headers) if headers else None, created_at=created_at, content_type=content_type
    )
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise InvalidMessage(
            ErrorCode.MESSAGE_TOO_LARGE, f"message is {len(payload)} bytes, more than a frame can carry"
        )
    return {"id": message_id, "subject": subject, "payload": payload, "key": key or None, "tags": list(tags)}


@dataclass(frozen=True)
class SendResult:
    """What became of one message: stored by `group`, or not (`error_code`, `error`)."""

    message_id: str
    subject: str
    ok: bool
    error_code: int | None = None
    error: str | None = None
    group: str | None = None


# ---- choosing groups -------------------------------------------------------------------------------


class GroupHealth:
    """Groups that failed a request lately, so that the next messages go elsewhere first (the meta
    server notices a dead broker only after its heartbeat timeout). Callers pass the clock."""

    def __init__(self, suspect_for_s: float = SUSPECT_FOR_S) -> None:
        self.suspect_for_s = suspect_for_s
        self._failed_at: dict[str, float] = {}

    def failed(self, group: str, now: float) -> None:
        self._failed_at[group] = now

    def succeeded(self, group: str) -> None:
        self._failed_at.pop(group, None)

    def suspect(self, group: str, now: float) -> bool:
        failed_at = self._failed_at.get(group)
        return failed_at is not None and now - failed_at < self.suspect_for_s


def choose_group(
    route: Route, message_id: str, *, tried: Sequence[str] = (), health: GroupHealth | None = None, now: float = 0.0
) -> tuple[RouteGroup | None, bool]:
    """The group to offer a message to, and whether it is one the message already failed on.

    Writable groups (available, not read-only) only; those the message has not been tried on come
    first, then groups that have not failed lately; among equals the message id picks, so messages
    spread evenly over the groups and a retry moves to the next group of the route."""
    writable = route.writable_groups
    if not writable:
        return None, False
    if len(writable) == 1 and not tried and (health is None or not health.suspect(writable[0].name, now)):
        return writable[0], False
    untried = [g for g in writable if g.name not in tried]
    candidates, again = (untried, False) if untried else (list(writable), True)
    if health is not None:
        healthy = [g for g in candidates if not health.suspect(g.name, now)]
        candidates = healthy or candidates
    return candidates[zlib.crc32(message_id.encode()) % len(candidates)], again


# ---- one send call ---------------------------------------------------------------------------------


@dataclass
class SendBatch:
    """One BROKER_SEND (or DELAY_SEND to a delay server): `indices` are the positions of its
    messages in the job."""

    group: str
    addresses: tuple[str, ...]
    indices: list[int]
    body: dict[str, Any]
    code: int = RequestCode.BROKER_SEND


def classify_send_error(exc: BaseException) -> tuple[bool, int, str]:
    """(worth trying elsewhere, error code, text) for an exception from a BROKER_SEND request."""
    if isinstance(exc, RemoteError):
        return exc.code in RETRIABLE_SEND_CODES, exc.code, str(exc)
    if isinstance(exc, ProtocolError):  # refused by our own connection, e.g. a frame over the limit
        return False, exc.code, str(exc)
    if isinstance(exc, TimeoutError):
        return True, ErrorCode.TIMEOUT, str(exc) or "timed out"
    if isinstance(exc, OSError):  # ConnectionError included
        return True, ErrorCode.UNAVAILABLE, str(exc) or type(exc).__name__
    return False, ErrorCode.INTERNAL, repr(exc)


class SendJob:
    """The state of one `send(messages)` call. The driver loops: fetch routes for
    `pending_subjects()`, `plan()` batches, send them, report each with `on_reply` or `on_error`,
    until `done`; then `results()`. Messages a broker would reject are answered at once."""

    def __init__(
        self,
        messages: Sequence[OutgoingMessage],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_attempts: int = SEND_ATTEMPTS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
    ) -> None:
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.max_batch_bytes = max_batch_bytes
        self.messages = list(messages)
        self.wires: list[dict[str, Any] | None] = []
        self._results: list[SendResult | None] = []
        self._tried: list[list[str]] = [[] for _ in self.messages]
        self._last_error: list[tuple[int, str] | None] = [None] * len(self.messages)
        self.retry_delay_s = 0.0  # set by plan(): wait this long before sending its batches
        self.delayed: list[bool] = []  # goes to a delay server (deliver_at in the future)
        now_ms = time.time_ns() // 1_000_000
        for message in self.messages:
            deliver_at = getattr(message, "deliver_at", None)
            self.delayed.append(deliver_at is not None and deliver_at > now_ms)
            try:
                self.wires.append(message.to_wire())
                if self.delayed[-1]:
                    self.wires[-1]["deliver_at"] = deliver_at
                self._results.append(None)
            except InvalidMessage as exc:
                self.wires.append(None)
                self._results.append(self._failure(message, exc.code, f"{error_name(exc.code)}: {exc}"))

    @property
    def done(self) -> bool:
        return all(r is not None for r in self._results)

    def results(self) -> list[SendResult]:
        assert self.done, "the send job still has messages to send"
        return [r for r in self._results if r is not None]

    def pending_subjects(self) -> set[str]:
        return {self.messages[i].subject for i in self._pending()}

    def fail_subject(self, subject: str, code: int, text: str) -> None:
        """Give up on every pending message of `subject` (its route cannot be had)."""
        for i in self._pending():
            if self.messages[i].subject == subject:
                self._results[i] = self._failure(self.messages[i], code, text)

    def plan(self, routes: Mapping[str, Route], health: GroupHealth | None = None, now: float = 0.0) -> list[SendBatch]:
        """The batches for the next round: each pending message offered to one group. Messages with
        no writable group left, or out of attempts, fail here with the last error they met."""
        by_group: dict[tuple[bool, str], tuple[RouteGroup, list[int]]] = {}
        self.retry_delay_s = 0.0
        for i in self._pending():
            message = self.messages[i]
            route = routes.get(message.subject)
            delayed = self.delayed[i]
            if delayed and route is not None:
                route = route.delay_route
            if len(self._tried[i]) >= self.max_attempts:
                code, text = self._last_error[i] or (ErrorCode.UNAVAILABLE, "no attempt left")
                tried = ", ".join(dict.fromkeys(self._tried[i]))
                self._results[i] = self._failure(
                    message, code, f"not stored after {len(self._tried[i])} attempts (on {tried}); last: {text}"
                )
                continue
            group, again = (
                choose_group(route, message.id, tried=self._tried[i], health=health, now=now)
                if route is not None
                else (None, False)
            )
            if group is None:
                text = (
                    "no delay server is available for delayed messages"
                    if delayed
                    else f"no writable broker group carries subject {message.subject!r}"
                )
                if self._last_error[i] is not None:
                    text += f" (last error: {self._last_error[i][1]})"
                self._results[i] = self._failure(message, ErrorCode.UNAVAILABLE, text)
                continue
            if again:
                self.retry_delay_s = RETRY_DELAY_S
            self._tried[i].append(group.name)
            by_group.setdefault((delayed, group.name), (group, []))[1].append(i)
        batches = []
        for (delayed, _name), (group, indices) in by_group.items():
            batch: list[int] = []
            size = 0
            for i in indices:
                wire = self.wires[i]
                assert wire is not None
                if batch and (len(batch) >= self.batch_size or size + len(wire["payload"]) > self.max_batch_bytes):
                    batches.append(self._batch(group, batch, delayed))
                    batch, size = [], 0
                batch.append(i)
                size += len(wire["payload"])
            if batch:
                batches.append(self._batch(group, batch, delayed))
        return batches

    def on_reply(self, batch: SendBatch, reply: dict[str, Any]) -> None:
        """Merge a BROKER_SEND reply: `rejected` lists [index in the batch, code, message]; every
        other message of the batch was stored."""
        rejected: dict[int, tuple[int, str]] = {}
        for item in reply.get("rejected") or ():
            index, code, text = item[0], int(item[1]), str(item[2])
            rejected[int(index)] = (code, text)
        for position, i in enumerate(batch.indices):
            message = self.messages[i]
            if position not in rejected:
                self._results[i] = SendResult(message.id, message.subject, True, group=batch.group)
                continue
            code, text = rejected[position]
            text = f"{error_name(code)}: {text}"
            if code in RETRIABLE_SEND_CODES:
                self._last_error[i] = (code, f"group {batch.group}: {text}")
            else:
                self._results[i] = self._failure(message, code, text)

    def on_error(self, batch: SendBatch, exc: BaseException) -> bool:
        """The whole request failed. Returns whether its messages will be tried again (on another
        group when the route has one); if not, they failed with this error."""
        retriable, code, text = classify_send_error(exc)
        for i in batch.indices:
            if retriable:
                self._last_error[i] = (code, f"group {batch.group}: {text}")
            else:
                self._results[i] = self._failure(self.messages[i], code, text)
        return retriable

    def _pending(self) -> list[int]:
        return [i for i, r in enumerate(self._results) if r is None]

    def _batch(self, group: RouteGroup, indices: list[int], delayed: bool = False) -> SendBatch:
        return SendBatch(
            group.name,
            group.addresses,
            indices,
            {"messages": [self.wires[i] for i in indices]},
            RequestCode.DELAY_SEND if delayed else RequestCode.BROKER_SEND,
        )

    @staticmethod
    def _failure(message: OutgoingMessage, code: int, text: str) -> SendResult:
        return SendResult(message.id, message.subject, False, error_code=int(code), error=text)


# ---- cancelling delayed messages -------------------------------------------------------------------

CANCEL_TIMEOUT_S = 10.0  # wait for one DELAY_CANCEL reply
CANCEL_OUTCOMES = ("cancelled", "too_late", "unknown")  # best first


def merge_cancel_outcomes(ids: Sequence[str], replies: Sequence[dict[str, Any]]) -> dict[str, str]:
    """One outcome per id from every delay server's DELAY_CANCEL reply: the message is on one of
    them, so the best outcome wins ("cancelled": it will never be delivered; "too_late": it was due
    already and was or is being delivered; "unknown": no delay server knows it)."""
    best = dict.fromkeys(ids, len(CANCEL_OUTCOMES) - 1)
    for reply in replies:
        for message_id, outcome in zip(ids, reply.get("outcomes") or (), strict=False):
            if outcome in CANCEL_OUTCOMES:
                best[message_id] = min(best[message_id], CANCEL_OUTCOMES.index(outcome))
    return {message_id: CANCEL_OUTCOMES[rank] for message_id, rank in best.items()}


# ---- consuming -------------------------------------------------------------------------------------


def default_consumer_id() -> str:
    """hostname-pid-random: unique per subscription, readable in the broker's logs."""
    raw = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"
    return re.sub(r"[^A-Za-z0-9._\-:@]", "-", raw)[-200:]


@dataclass(frozen=True)
class SubscribeOptions:
    """What a subscription asks the brokers for; checked here so a mistake is named at once."""

    subject: str
    group: str
    consumer: str = field(default_factory=default_consumer_id)
    tags: tuple[str, ...] = ()
    match_all: bool = False
    broadcast: bool = False
    start: str = "latest"

    def __post_init__(self) -> None:
        try:
            validate_subject(self.subject)
            object.__setattr__(self, "tags", validate_tags(list(self.tags)))
        except ProtocolError as exc:
            raise ValueError(exc.message) from None
        if not isinstance(self.group, str) or len(self.group) > MAX_GROUP_LEN or not GROUP_RE.fullmatch(self.group):
            raise ValueError(
                f"group {self.group!r} must be 1-{MAX_GROUP_LEN} letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        if not isinstance(self.consumer, str) or not CONSUMER_RE.fullmatch(self.consumer):
            raise ValueError(f"consumer {self.consumer!r} must be 1-200 letters, digits, '.', '_', '-', ':' or '@'")
        if self.start not in STARTS:
            raise ValueError(f"start must be 'latest' or 'earliest', not {self.start!r}")


@dataclass(frozen=True, eq=False)
class Delivery:
    """A message as a consumer gets it. Acknowledge it with the subscription that pulled it.

    `attempt` is 1 on the first delivery and grows with each retry; `created_at` is the producer's
    clock (None for a message not sent by a qmq client), `stored_at` the broker's. The fields after
    `payload` say where to acknowledge it; `epoch` tells a delivery made before its tracker was
    dropped (its ack is ignored, and the broker delivers it again)."""

    id: str
    subject: str
    body: Any
    content_type: str
    headers: dict[str, str]
    tags: tuple[str, ...]
    key: str | None
    attempt: int
    created_at: datetime | None
    stored_at: datetime | None
    payload: bytes
    broker: str
    stored_subject: str
    group_key: str
    consumer: str
    pull_seq: int
    epoch: int

    @property
    def is_retry(self) -> bool:
        """Whether it came through the group's retry subject."""
        return self.stored_subject != self.subject


def ms_to_datetime(ms: int | None) -> datetime | None:
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


TrackerKey = tuple[str, str, str, str]  # broker address, stored subject, group key, consumer


class AckTracker:
    """The pull sequences one broker handed one consumer on one stored subject, and which are done.

    The broker numbers what it hands out 0, 1, 2, ... and takes acks as prefixes. `receive` records a
    batch and returns the sequences that are new (a resent batch may repeat ones already here);
    `done` marks one finished, in any order; `take_ack` returns the end of the contiguous finished
    prefix when it moved, to send as `[stored_subject, group_key, consumer, last_pull]`. `pulled` is
    the end of the contiguous received prefix: telling the broker that number makes it resend
    anything after it that is not acknowledged, which also fills any gap."""

    def __init__(self, key: TrackerKey, epoch: int) -> None:
        self.key = key
        self.epoch = epoch
        self.base: int | None = None  # the first pull sequence this tracker saw
        self.received_upto = -1  # every sequence from base to here was received
        self.done_upto = -1  # every sequence from base to here is done
        self.acked_upto = -1  # the last ack handed out by take_ack covers up to here
        self._received: set[int] = set()  # received, above received_upto
        self._done: set[int] = set()  # done, above done_upto

    @property
    def pulled(self) -> int | None:
        return self.received_upto if self.base is not None else None

    @property
    def outstanding(self) -> int:
        """Received and not yet done."""
        if self.base is None:
            return 0
        return (self.received_upto - self.done_upto) + len(self._received) - len(self._done)

    @property
    def last_received(self) -> int | None:
        """The highest sequence received, gaps or not."""
        if self.base is None:
            return None
        return max(self.received_upto, max(self._received, default=self.received_upto))

    def receive(self, first_pull: int, count: int) -> list[int]:
        if self.base is None:
            self.base = first_pull
            self.received_upto = self.done_upto = self.acked_upto = first_pull - 1
        new = []
        for seq in range(first_pull, first_pull + count):
            if seq > self.received_upto and seq not in self._received:
                new.append(seq)
                self._received.add(seq)
        while self.received_upto + 1 in self._received:
            self.received_upto += 1
            self._received.discard(self.received_upto)
        return new

    def done(self, pull_seq: int) -> None:
        if pull_seq <= self.done_upto or not self._was_received(pull_seq):
            return
        self._done.add(pull_seq)
        while self.done_upto + 1 in self._done:
            self.done_upto += 1
            self._done.discard(self.done_upto)

    def take_ack(self) -> int | None:
        if self.done_upto > self.acked_upto:
            self.acked_upto = self.done_upto
            return self.done_upto
        return None

    def _was_received(self, seq: int) -> bool:
        return self.base is not None and self.base <= seq and (seq <= self.received_upto or seq in self._received)


class SubscriptionState:
    """Everything a subscription knows between requests: its options and its ack trackers.
    Not thread-safe; the blocking driver holds a lock around it."""

    def __init__(self, options: SubscribeOptions) -> None:
        self.options = options
        self._trackers: dict[TrackerKey, AckTracker] = {}
        self._epochs = itertools.count(1)
        self._drops: dict[str, int] = defaultdict(int)  # trackers dropped so far, by broker address

    def generation(self, address: str) -> int:
        """Changes whenever a tracker of `address` is dropped. A pull reply is only accepted with
        the generation its request was built under (see `accept`)."""
        return self._drops[address]

    def pull_request(self, address: str, max_count: int, wait_s: float) -> dict[str, Any]:
        """The BROKER_PULL body; `pulled` names, per stored subject, the end of what this consumer
        received without a gap, so the broker resends anything after it not yet acknowledged."""
        o = self.options
        pulled = {key[1]: t.pulled for key, t in self._trackers.items() if key[0] == address and t.pulled is not None}
        return {
            "subject": o.subject,
            "group": o.group,
            "consumer": o.consumer,
            "max": max(1, min(max_count, 4096)),
            "wait_ms": int(max(0.0, min(wait_s, MAX_PULL_WAIT_S)) * 1000),
            "tags": list(o.tags),
            "match_all": o.match_all,
            "broadcast": o.broadcast,
            "start": o.start,
            "pulled": pulled,
        }

    def accept(self, address: str, reply: dict[str, Any], generation: int | None = None) -> list[Delivery]:
        """The new deliveries in a BROKER_PULL reply from `address`, in the order given.

        A tracker starts at the first batch it gets, and its acks cover everything below: so it
        may only start from a reply to a request that did not name it in `pulled` (the broker then
        begins at its first unacknowledged sequence). A reply to a request built before a tracker
        of this address was dropped (`generation` differs) is ignored whole: the next pull gets its
        messages again. A batch of new messages numbered at or below what the tracker already
        received means the broker forgot this consumer's pulls (its state went back): the tracker is
        dropped and the batch ignored; the next pull, naming nothing, gets all that is not
        acknowledged again."""
        if generation is not None and generation != self._drops[address]:
            return []
        deliveries = []
        for batch in reply.get("batches") or ():
            stored, group_key, first = str(batch["subject"]), str(batch["group"]), int(batch["first_pull"])
            messages = batch.get("messages") or []
            key = (address, stored, group_key, self.options.consumer)
            tracker = self._trackers.get(key)
            last = tracker.last_received if tracker is not None else None
            if last is not None and not batch.get("resent") and first <= last:  # (0 is a sequence too)
                del self._trackers[key]  # resent from the broker's ack point by the next pull
                self._drops[address] += 1
                continue
            if tracker is None:
                tracker = self._trackers[key] = AckTracker(key, next(self._epochs))
            new = set(tracker.receive(first, len(messages)))
            for offset, message in enumerate(messages):
                if first + offset in new:
                    deliveries.append(self._delivery(tracker, first + offset, message))
        return deliveries

    def is_current(self, delivery: Delivery) -> bool:
        """False for a delivery whose tracker was dropped since: its ack would mean nothing."""
        tracker = self._trackers.get(_key(delivery))
        return tracker is not None and tracker.epoch == delivery.epoch

    def done(self, delivery: Delivery) -> bool:
        """Mark a delivery finished (acknowledged, or nacked and so handed back); False if stale."""
        if not self.is_current(delivery):
            return False
        self._trackers[_key(delivery)].done(delivery.pull_seq)
        return True

    def take_acks(self) -> dict[str, list[list[Any]]]:
        """BROKER_ACK entries by broker address, for every tracker whose finished prefix moved."""
        acks: dict[str, list[list[Any]]] = defaultdict(list)
        for (address, stored, group_key, consumer), tracker in self._trackers.items():
            last_pull = tracker.take_ack()
            if last_pull is not None:
                acks[address].append([stored, group_key, consumer, last_pull])
        return dict(acks)

    def drop(self, address: str, entries: Iterable[Sequence[Any]] | None = None) -> int:
        """Forget the trackers of `address` named by ack `entries` (all of them when None): the broker
        will resend what they held that it had not seen acknowledged. Returns how many were dropped."""
        if entries is None:
            keys = [k for k in self._trackers if k[0] == address]
        else:
            keys = [(address, str(e[0]), str(e[1]), str(e[2])) for e in entries]
        dropped = sum(self._trackers.pop(k, None) is not None for k in keys)
        if dropped:
            self._drops[address] += 1
        return dropped

    def drop_delivery(self, delivery: Delivery) -> None:
        """Forget the tracker of one delivery (its nack could not be delivered)."""
        if self.is_current(delivery):
            del self._trackers[_key(delivery)]
            self._drops[delivery.broker] += 1

    def nack_request(
        self,
        delivery: Delivery,
        delay_s: float,
        *,
        dead: bool = False,
        reason: str = "",
        max_attempts: int | None = None,
    ) -> dict[str, Any]:
        if not delay_s >= 0 or delay_s == float("inf"):
            raise ValueError(f"delay_s must be a finite number of seconds >= 0, not {delay_s!r}")
        if max_attempts is not None and max_attempts < 1:
            raise ValueError("max_attempts must be at least 1")
        nack: dict[str, Any] = {
            "subject": delivery.stored_subject,
            "group": delivery.group_key,
            "consumer": delivery.consumer,
            "pull_seq": delivery.pull_seq,
            "attempt": delivery.attempt,
            "delay_ms": int(delay_s * 1000),
            "dead": bool(dead),
            "reason": str(reason)[:1000],
        }
        if max_attempts is not None:
            nack["max_attempts"] = int(max_attempts)
        return {"nacks": [nack]}

    def heartbeat_requests(self) -> dict[str, dict[str, Any]]:
        """BROKER_HEARTBEAT bodies by broker address, naming every stored subject this consumer holds."""
        consumers: dict[str, list[list[str]]] = defaultdict(list)
        for address, stored, group_key, consumer in self._trackers:
            consumers[address].append([stored, group_key, consumer])
        return {address: {"consumers": items} for address, items in consumers.items()}

    @property
    def outstanding(self) -> int:
        """Deliveries handed out and not yet finished."""
        return sum(t.outstanding for t in self._trackers.values())

    def _delivery(self, tracker: AckTracker, pull_seq: int, message: dict[str, Any]) -> Delivery:
        address, stored, group_key, consumer = tracker.key
        payload = bytes(message.get("payload") or b"")
        env = envelope.decode(payload)
        return Delivery(
            id=str(message["id"]),
            subject=str(message.get("subject") or self.options.subject),
            body=env.body,
            content_type=env.content_type,
            headers=dict(env.headers),
            tags=tuple(message.get("tags") or ()),
            key=message.get("key"),
            attempt=int(message.get("attempt") or 1),
            created_at=ms_to_datetime(env.created_at),
            stored_at=ms_to_datetime(message.get("stored_at")),
            payload=payload,
            broker=address,
            stored_subject=stored,
            group_key=group_key,
            consumer=consumer,
            pull_seq=pull_seq,
            epoch=tracker.epoch,
        )


def _key(delivery: Delivery) -> TrackerKey:
    return (delivery.broker, delivery.stored_subject, delivery.group_key, delivery.consumer)


@dataclass
class PullSlot:
    """One broker group of a subscription's route and the pull in flight to it, if any (a
    concurrent Future or an asyncio Task: both have done() and result())."""

    group: RouteGroup
    pending: Any = None
    address: str = ""  # where the pull in flight went
    due: float = 0.0  # when its reply is expected at the latest, before PULL_REPLY_GRACE_S (monotonic)
    generation: int = 0  # SubscriptionState.generation(address) when its request was built
    failures: int = 0  # pulls failed in a row
    retry_at: float = 0.0  # no new pull before this (monotonic)

    def can_pull(self, now: float) -> bool:
        return self.pending is None and self.retry_at <= now

    def sent(self, pending: Any, address: str, due: float, generation: int) -> None:
        self.pending, self.address, self.due, self.generation = pending, address, due, generation

    def failed(self, now: float) -> bool:
        """Note a failed pull and when to try again; True when it is worth a warning (the first
        failure is retried at once, and is usually a connection that a reconnect fixes)."""
        self.failures += 1
        self.retry_at = now + pull_retry_delay_s(self.failures)
        return self.failures == 2

    def succeeded(self) -> bool:
        """Note a pull that worked; True when it ends a run of failures that was warned about."""
        warned, self.failures = self.failures >= 2, 0
        return warned


def update_slots(slots: dict[str, PullSlot], route: Route) -> None:
    """Add the route's new groups (routes only grow) and take in changed addresses and flags."""
    for group in route.groups:
        if not group.addresses:
            continue
        slot = slots.get(group.name)
        if slot is None:
            slots[group.name] = PullSlot(group)
        else:
            slot.group = group


def pull_retry_delay_s(failures: int) -> float:
    """How long to leave a broker alone after `failures` failed pulls in a row: the first failure
    is retried at once (a lost connection is simply reopened), then the wait doubles."""
    if failures <= 1:
        return 0.0
    return min(PULL_RETRY_MAX_DELAY_S, PULL_RETRY_DELAY_S * 2 ** (failures - 2))


def is_fatal_pull_error(exc: BaseException) -> bool:
    """A pull error that repeating cannot fix: the subscription's own request is refused."""
    return isinstance(exc, RemoteError) and exc.code in FATAL_PULL_CODES
