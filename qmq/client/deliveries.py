"""What a subscription asks for, what it was handed, and what it must acknowledge, without I/O.

`SubscribeOptions` are checked with the broker's own checks (`qmq.protocol.limits`), so that a
subscription no broker would serve is refused before any request. A `SubscriptionState` builds pull
requests, turns pull replies into `Delivery` objects and keeps one `AckTracker` per (broker group, stored
subject, group key, consumer). The broker's acks are prefixes (docs/broker.md): the tracker collects
completions in any order and releases the contiguous completed prefix as one ack entry. A tracker that
lost touch with its broker is dropped: the broker resends whatever it had not seen acknowledged, so
nothing is lost, at the price of a duplicate.

Trackers belong to a broker *group*, not to an address: a replicated group's pull logs are in its
replicated journal, so after a failover the new master knows the pull sequences its old master
handed out, and the acks, heartbeats and the next pull's `pulled` go to it (the caller sends each
group's requests to the group's current master). Where the new master never got the last of them,
it says so: a `behind` batch cuts the tracker where its pull log ends (`AckTracker.cut`); an ack it
refuses drops the tracker as above.
"""

from __future__ import annotations

import functools
import itertools
import os
import secrets
import socket
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NamedTuple

from qmq.client.errors import InvalidSubscription
from qmq.client.messages import set_fields
from qmq.protocol import envelope
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.limits import (
    MAX_PULL_MESSAGES,
    MAX_PULL_WAIT_MS,
    consumer_id_from,
    validate_consumer,
    validate_group,
    validate_subject,
    validate_tags,
)

DEFAULT_PULL_MAX = 64  # messages asked for in one pull
DEFAULT_PULL_WAIT_S = 2.5  # long polling: how long a pull waits for a message
MAX_PULL_WAIT_S = MAX_PULL_WAIT_MS / 1000  # the broker's limit
DATETIME_CACHE_SIZE = 4096  # distinct milliseconds whose datetime is kept (ms_to_datetime)
PULL_REPLY_GRACE_S = 5.0  # a pull's reply may arrive this long after its wait before it is a timeout
STARTS = ("latest", "earliest")


def default_consumer_id() -> str:
    """hostname-pid-random: unique per subscription, readable in the broker's logs."""
    return consumer_id_from(f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")


@dataclass(frozen=True)
class SubscribeOptions:
    """What a subscription asks the brokers for, checked here as a broker checks a pull, so that a
    mistake is named at once: `InvalidSubscription` (a ValueError) with the broker's error code."""

    subject: str
    group: str
    consumer: str = field(default_factory=default_consumer_id)
    tags: tuple[str, ...] = ()
    match_all: bool = False
    broadcast: bool = False
    start: str = "latest"
    ordered: bool = False  # pulls name the queues held (`SubscriptionState.queues`; docs/ordering.md)
    # The next pull goes out as soon as a reply is in, while the application works on it (see
    # `SubscriptionCore.pull`); False: a pull is asked for only when the application calls pull().
    prefetch: bool = False
    # A pull that waits asks the broker to serve it ahead (qmq/broker/ahead.py): messages stored
    # between its reply and the next pull, up to the room it left, wait for that pull already
    # journalled. Implied by `prefetch`; the worker asks for it without prefetching.
    serve_ahead: bool = False

    def __post_init__(self) -> None:
        try:
            validate_subject(self.subject)
            validate_group(self.group)
            validate_consumer(self.consumer)
            object.__setattr__(self, "tags", validate_tags(list(self.tags)))
        except ProtocolError as exc:
            raise InvalidSubscription(exc.code, exc.message) from None
        if self.start not in STARTS:
            raise InvalidSubscription(
                ErrorCode.BAD_REQUEST, f"start must be 'latest' or 'earliest', not {self.start!r}"
            )


@dataclass(frozen=True, eq=False)
class Delivery:
    """A message as a consumer gets it. Acknowledge it with the subscription that pulled it.

    `attempt` is 1 on the first delivery and grows with each retry; `created_at` is the producer's
    clock (None for a message not sent by a qmq client), `stored_at` the broker's. The fields after
    `payload` say where to acknowledge it: `broker_group` is the broker group that handed it out
    (its acknowledgement goes to that group's master, wherever it is by then), `broker` the address
    it came from; `epoch` tells a delivery made before its tracker was dropped, or cut below it (its
    ack is ignored, and the broker delivers it again)."""

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
    broker_group: str
    stored_subject: str
    group_key: str
    consumer: str
    pull_seq: int
    epoch: int

    @property
    def is_retry(self) -> bool:
        """Whether it came through the group's retry subject."""
        return self.stored_subject != self.subject


@functools.lru_cache(maxsize=DATETIME_CACHE_SIZE)
def ms_to_datetime(ms: int | None) -> datetime | None:
    """Cached: the messages of one pull mostly share their store and creation milliseconds."""
    if ms is None:
        return None
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


TrackerKey = tuple[str, str, str, str]  # broker group, stored subject, group key, consumer


class AckTracker:
    """The pull sequences one broker group handed one consumer on one stored subject, and which are
    done.

    The broker numbers what it hands out 0, 1, 2, ... and takes acks as prefixes. `receive` records a
    batch and returns the sequences that are new (a resent batch may repeat ones already here);
    `done` marks one finished, in any order; `take_ack` returns the end of the contiguous finished
    prefix when it moved, to send as `[stored_subject, group_key, consumer, last_pull]`. `pulled` is
    the end of the contiguous received prefix: telling the broker that number makes it resend
    anything after it that is not acknowledged, which also fills any gap."""

    def __init__(self, key: TrackerKey, epoch: int) -> None:
        self.key = key
        self.epoch = epoch
        self.address = key[0]  # where its last batch came from (the group's master then)
        # epochs before a `cut`: their deliveries numbered below the cut still count
        self.valid_below: dict[int, int] = {}
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
        elif first_pull > self.received_upto + 1:
            self._skipped(first_pull)
        new = []
        for seq in range(first_pull, first_pull + count):
            if seq > self.received_upto and seq not in self._received:
                new.append(seq)
                self._received.add(seq)
        while self.received_upto + 1 in self._received:
            self.received_upto += 1
            self._received.discard(self.received_upto)
        return new

    def _skipped(self, first_pull: int) -> None:
        """The broker answered from `first_pull` though this consumer named `received_upto` as the end
        of what it received: it resends everything after that which is not acknowledged, so the
        sequences in between that never arrived are acknowledged there (given to another consumer: a
        silent consumer's release, an ordered queue's new holder). They count as received and done
        here, or the acknowledgements would wait for them for ever."""
        for seq in range(self.received_upto + 1, first_pull):
            if seq not in self._received:
                self._received.add(seq)
                self._done.add(seq)
        while self.received_upto + 1 in self._received:
            self.received_upto += 1
            self._received.discard(self.received_upto)
        while self.done_upto + 1 in self._done:
            self.done_upto += 1
            self._done.discard(self.done_upto)

    def done(self, pull_seq: int) -> None:
        if pull_seq <= self.done_upto or not self._was_received(pull_seq):
            return
        self._done.add(pull_seq)
        while self.done_upto + 1 in self._done:
            self.done_upto += 1
            self._done.discard(self.done_upto)

    def holds(self, epoch: int, pull_seq: int) -> bool:
        """Whether a delivery made under `epoch` with `pull_seq` is still this tracker's to finish."""
        return epoch == self.epoch or pull_seq < self.valid_below.get(epoch, -1)

    def cut(self, end: int, epoch: int) -> bool:
        """The group's master numbers this consumer's next pull `end`, below what this tracker received:
        a failover's new master that never got the old master's last pull entries. Sequences from
        `end` on are forgotten (deliveries of them no longer count: the new master hands their
        messages out again), those below are the same there and stay (their acks go to the new
        master, which may not have the old one's last acks: the finished prefix is sent again).
        Returns False when nothing below `end` is left: the tracker must be dropped."""
        if self.base is None or end <= self.base:
            return False
        for old in self.valid_below:
            self.valid_below[old] = min(self.valid_below[old], end)
        self.valid_below[self.epoch] = end
        self.epoch = epoch
        self.received_upto = min(self.received_upto, end - 1)
        self.done_upto = min(self.done_upto, end - 1)
        self._received = {s for s in self._received if s < end}
        self._done = {s for s in self._done if s < end}
        self.acked_upto = self.base - 1
        return True

    def take_ack(self) -> int | None:
        if self.done_upto > self.acked_upto:
            self.acked_upto = self.done_upto
            return self.done_upto
        return None

    def _was_received(self, seq: int) -> bool:
        return self.base is not None and self.base <= seq and (seq <= self.received_upto or seq in self._received)


class Arrived(NamedTuple):
    """A message of a pull reply taken in by its tracker, its `Delivery` not built yet."""

    tracker: AckTracker
    pull_seq: int
    message: dict[str, Any]


class SubscriptionState:
    """Everything a subscription knows between requests: its options and its ack trackers.
    Not thread-safe; the blocking driver holds a lock around it."""

    def __init__(self, options: SubscribeOptions) -> None:
        self.options = options
        self._trackers: dict[TrackerKey, AckTracker] = {}
        self._epochs = itertools.count(1)
        self._drops: dict[str, int] = defaultdict(int)  # trackers dropped so far, by broker group
        # An ordered subscription's queues whose leases it holds: its pulls take only those.
        self.queues: list[int] | None = [] if options.ordered else None
        self._served_ahead_by: set[str] = set()  # groups asked to serve ahead: each is told of the leave
        self._moved: dict[str, str] = {}  # group -> its new master, whose first pull reply is awaited

    def generation(self, group: str) -> int:
        """Changes whenever a tracker of broker group `group` is dropped. A pull reply is only
        accepted with the generation its request was built under (see `accept`)."""
        return self._drops[group]

    def pull_request(self, group: str, max_count: int, wait_s: float) -> dict[str, Any]:
        """The BROKER_PULL body for broker group `group`; `pulled` names, per stored subject, the end
        of what this consumer received without a gap, so the broker resends anything after it not yet
        acknowledged."""
        o = self.options
        pulled = {key[1]: t.pulled for key, t in self._trackers.items() if key[0] == group and t.pulled is not None}
        count = max(1, min(max_count, MAX_PULL_MESSAGES))
        asks_ahead = self._asks_ahead(wait_s)
        if asks_ahead:
            self._served_ahead_by.add(group)
        return {
            "subject": o.subject,
            "group": o.group,
            "consumer": o.consumer,
            "max": count,
            "wait_ms": int(max(0.0, min(wait_s, MAX_PULL_WAIT_S)) * 1000),
            "tags": list(o.tags),
            "match_all": o.match_all,
            "broadcast": o.broadcast,
            "start": o.start,
            "pulled": pulled,
            **({"queues": list(self.queues)} if self.queues is not None else {}),
            # a pull that waits (not the subscription's registration): what is stored before the
            # next pull arrives is served ahead (qmq/broker/ahead.py)
            **({"ahead": count} if asks_ahead else {}),
        }

    def _asks_ahead(self, wait_s: float) -> bool:
        o = self.options
        return (o.prefetch or o.serve_ahead) and wait_s > 0 and self.queues is None and not o.broadcast

    def accept(
        self, group: str, reply: dict[str, Any], generation: int | None = None, address: str | None = None
    ) -> list[Delivery]:
        """The new deliveries in a BROKER_PULL reply from broker group `group`, in the order given
        (`receive`, then `deliveries`)."""
        return self.deliveries(self.receive(group, reply, generation, address))

    def receive(
        self, group: str, reply: dict[str, Any], generation: int | None = None, address: str | None = None
    ) -> list[Arrived]:
        """Take in a BROKER_PULL reply from broker group `group` (its master at `address`, by default
        the group's name): its trackers learn what was received (so the next pull request names it),
        and the new messages come back unbuilt, in the order given, for `deliveries`. A subscription
        that prefetches puts its next pull in flight between the two.

        A tracker starts at the first batch it gets, and its acks cover everything below: so it
        may only start from a reply to a request that did not name it in `pulled` (the broker then
        begins at its first unacknowledged sequence). A reply to a request built before a tracker
        of this group was dropped (`generation` differs) is ignored whole: the next pull gets its
        messages again. A batch numbered at or below what the tracker already received (new
        messages, or none with `behind`: the broker's answer to a `pulled` past its own pull log)
        means the broker forgot this consumer's pulls (its state went back: a failover's new master
        that never got its old master's last pulls). With `behind`, the tracker is cut where the
        broker's pull log ends (`AckTracker.cut`): what lies below is the same there and is still
        acknowledged, what lies above comes again. Otherwise the tracker is dropped and the batch
        ignored; the next pull, naming nothing, gets all that is not acknowledged again."""
        if generation is not None and generation != self._drops[group]:
            return []
        arrived: list[Arrived] = []
        for batch in reply.get("batches") or ():
            stored, group_key, first = str(batch["subject"]), str(batch["group"]), int(batch["first_pull"])
            messages = batch.get("messages") or []
            key = (group, stored, group_key, self.options.consumer)
            tracker = self._trackers.get(key)
            last = tracker.last_received if tracker is not None else None
            if last is not None and not batch.get("resent") and first <= last:  # (0 is a sequence too)
                if batch.get("behind") and tracker is not None and tracker.cut(first, next(self._epochs)):
                    continue  # the next pull names `first - 1` as received: new ones from there
                del self._trackers[key]  # resent from the broker's ack point by the next pull
                self._drops[group] += 1
                continue
            if batch.get("behind"):  # (always at or below `last` above: the broker's pull log ends there)
                continue
            if tracker is None:
                tracker = self._trackers[key] = AckTracker(key, next(self._epochs))
            tracker.address = address or group
            new = set(tracker.receive(first, len(messages)))
            for offset, message in enumerate(messages):
                if first + offset in new:
                    arrived.append(Arrived(tracker, first + offset, message))
        if address is not None and self._moved.get(group) == address:
            self._confirm(group)  # its new master answered: acks go to it again
        return arrived

    def deliveries(self, arrived: Iterable[Arrived]) -> list[Delivery]:
        """The `Delivery` of each message `receive` took in (the envelope decoded, the times made)."""
        return [self._delivery(tracker, pull_seq, message) for tracker, pull_seq, message in arrived]

    def is_current(self, delivery: Delivery) -> bool:
        """False for a delivery whose tracker was dropped since: its ack would mean nothing."""
        tracker = self._trackers.get(tracker_key(delivery))
        return tracker is not None and tracker.holds(delivery.epoch, delivery.pull_seq)

    def done(self, delivery: Delivery) -> bool:
        """Mark a delivery finished (acknowledged, or nacked and so handed back); False if stale."""
        tracker = self._trackers.get(tracker_key(delivery))
        if tracker is None or not tracker.holds(delivery.epoch, delivery.pull_seq):
            return False
        tracker.done(delivery.pull_seq)
        return True

    def master_moved(self, group: str, address: str) -> None:
        """The route names a new master for broker group `group`, at `address`. It has the pull logs
        its old master copied to it, maybe not the last pulls nor the last acks (acks the old master
        took included). So the group's acks wait for its first pull reply, which says where its pull
        log ends for each tracker (`behind`: the tracker is cut there); then every tracker's finished
        prefix is sent again. An ack sent before would be refused past that end, and forget all."""
        self._moved[group] = address

    def _confirm(self, group: str) -> None:
        del self._moved[group]
        for key, tracker in self._trackers.items():
            if key[0] == group and tracker.base is not None:
                tracker.acked_upto = tracker.base - 1

    def take_acks(self) -> dict[str, list[list[Any]]]:
        """BROKER_ACK entries by broker group, for every tracker whose finished prefix moved (none
        for a group whose new master has not answered a pull yet: `master_moved`)."""
        acks: dict[str, list[list[Any]]] = defaultdict(list)
        for (group, stored, group_key, consumer), tracker in self._trackers.items():
            if group in self._moved:
                continue
            last_pull = tracker.take_ack()
            if last_pull is not None:
                acks[group].append([stored, group_key, consumer, last_pull])
        return dict(acks)

    def ack_again(self, group: str, entries: Iterable[Sequence[Any]]) -> None:
        """Ack `entries` that may not have reached broker group `group` (no connection, no reply, no
        master): the next `take_acks` gives them again, to wherever the group's master is by then.
        Acks are prefixes, so one that did arrive changes nothing when it comes twice."""
        for stored, group_key, consumer, last_pull in entries:
            tracker = self._trackers.get((group, str(stored), str(group_key), str(consumer)))
            if tracker is not None and tracker.acked_upto >= last_pull:
                tracker.acked_upto = last_pull - 1

    def drop(self, group: str, entries: Iterable[Sequence[Any]] | None = None) -> int:
        """Forget the trackers of broker group `group` named by ack `entries` (all of them when None):
        the broker will resend what they held that it had not seen acknowledged. Returns how many were
        dropped."""
        if entries is None:
            keys = [k for k in self._trackers if k[0] == group]
        else:
            keys = [(group, str(e[0]), str(e[1]), str(e[2])) for e in entries]
        dropped = sum(self._trackers.pop(k, None) is not None for k in keys)
        if dropped:
            self._drops[group] += 1
        return dropped

    def drop_delivery(self, delivery: Delivery) -> None:
        """Forget the tracker of one delivery (its nack could not be delivered)."""
        if self.is_current(delivery):
            del self._trackers[tracker_key(delivery)]
            self._drops[delivery.broker_group] += 1

    def nack_request(
        self,
        delivery: Delivery,
        delay_s: float,
        *,
        dead: bool = False,
        reason: str = "",
        max_attempts: int | None = None,
        stop_key: str | None = None,
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
        if stop_key is not None:  # an ordered key stops behind this dead letter (docs/ordering.md)
            nack["stop_key"] = stop_key
        return {"nacks": [nack]}

    def leave_requests(self, not_handed: Iterable[tuple[TrackerKey, int]]) -> dict[str, dict[str, Any]]:
        """BROKER_LEAVE bodies by broker group, one entry per tracker: `[stored_subject, group_key,
        consumer, seen]`, where `seen` is the last pull sequence handed to the application. `not_handed`
        names (tracker key, pull sequence) of what was received and not handed out: the broker gives
        those back without counting an attempt, like anything it handed out that never arrived. A
        broker asked to serve ahead that sent nothing is told too (`seen` -1): it may have reserved
        messages for this consumer since its last pull."""
        first_not_handed: dict[TrackerKey, int] = {}
        for key, pull_seq in not_handed:
            first_not_handed[key] = min(pull_seq, first_not_handed.get(key, pull_seq))
        leaves: dict[str, list[list[Any]]] = defaultdict(list)
        for key, tracker in self._trackers.items():
            last = tracker.last_received
            if last is None:
                continue
            seen = min(last, first_not_handed.get(key, last + 1) - 1)
            leaves[key[0]].append([key[1], key[2], key[3], seen])
        o = self.options
        for group in self._served_ahead_by - leaves.keys():  # received nothing there, but may hold
            leaves[group].append([o.subject, o.group, o.consumer, -1])  # what it was served ahead
        return {group: {"leaves": items} for group, items in leaves.items()}

    def heartbeat_requests(self) -> dict[str, dict[str, Any]]:
        """BROKER_HEARTBEAT bodies by broker group, naming every stored subject this consumer holds."""
        consumers: dict[str, list[list[str]]] = defaultdict(list)
        for group, stored, group_key, consumer in self._trackers:
            consumers[group].append([stored, group_key, consumer])
        return {group: {"consumers": items} for group, items in consumers.items()}

    @property
    def outstanding(self) -> int:
        """Deliveries handed out and not yet finished."""
        return sum(t.outstanding for t in self._trackers.values())

    def _delivery(self, tracker: AckTracker, pull_seq: int, message: dict[str, Any]) -> Delivery:
        broker_group, stored, group_key, consumer = tracker.key
        payload = message.get("payload") or b""
        if type(payload) is not bytes:
            payload = bytes(payload)
        env = envelope.decode(payload)  # headers: a dict of its own for each delivery
        message_id, subject = str(message["id"]), str(message.get("subject") or self.options.subject)
        tags, attempt = tuple(message.get("tags") or ()), int(message.get("attempt") or 1)
        delivery = object.__new__(Delivery)  # one per message received: no per-field __setattr__
        set_fields(
            delivery,
            {
                "id": message_id,
                "subject": subject,
                "body": env.body,
                "content_type": env.content_type,
                "headers": env.headers,
                "tags": tags,
                "key": message.get("key"),
                "attempt": attempt,
                "created_at": ms_to_datetime(env.created_at),
                "stored_at": ms_to_datetime(message.get("stored_at")),
                "payload": payload,
                "broker": tracker.address,
                "broker_group": broker_group,
                "stored_subject": stored,
                "group_key": group_key,
                "consumer": consumer,
                "pull_seq": pull_seq,
                "epoch": tracker.epoch,
            },
        )
        return delivery


def tracker_key(delivery: Delivery) -> TrackerKey:
    return (delivery.broker_group, delivery.stored_subject, delivery.group_key, delivery.consumer)
