"""Consuming: a subscription's loops, without I/O, shared by `Subscription` and `AsyncSubscription`.

`SubscriptionCore` holds everything a subscription knows between requests: its `SubscriptionState`
(what it was handed and must acknowledge), a `PullSlot` per broker group of its route (the pull in
flight there, and its failures), and the deliveries received and not yet returned. Its operations
are loops of steps (`qmq.client.steps`): a pull round long-polls every group at once and returns as
soon as one has messages, leaving the others in flight for the next call; acknowledgements wait and
go out in batches (at the latest every ACK_FLUSH_INTERVAL_S, and before a pull waits: then in flight
beside the pull, not awaited before it, so the long poll is in place one round trip sooner). What a
broker refuses to acknowledge is forgotten, and it delivers those messages again; acks that did not
get through go again with the next. Acknowledgements, nacks, heartbeats and leaves go to the broker
group that handed the messages out, at the address of its master as the route names it now: after
a failover, the new master takes them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from qmq.client.deliveries import (
    DEFAULT_PULL_MAX,
    DEFAULT_PULL_WAIT_S,
    PULL_REPLY_GRACE_S,
    Arrived,
    Delivery,
    SubscribeOptions,
    SubscriptionState,
    tracker_key,
)
from qmq.client.errors import ClientError, ConnectFailed
from qmq.client.routes import Route, RouteGroup, no_route_error, with_epoch
from qmq.client.steps import Call, Calls, GetRoute, Sleep, Start, Steps, WaitAll, WaitAny, outcome
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError

if TYPE_CHECKING:
    from qmq.client.core import ClientCore

log = logging.getLogger("qmq.client")

PULL_RETRY_DELAY_S = 0.5  # after a broker failed a pull twice in a row, then doubling...
# ...up to this (Kafka's reconnect.backoff.max.ms): a failover's new master is pulled from within 1 s
# of taking office, not up to 5 s after (tests/test_replication_chaos.py prints it)
PULL_RETRY_MAX_DELAY_S = 1.0
ACK_FLUSH_INTERVAL_S = 1.0  # acknowledgements wait at most this long (while pull or ack is called)
ACK_TIMEOUT_S = 10.0  # wait for a BROKER_ACK, BROKER_NACK or BROKER_HEARTBEAT reply
LEAVE_TIMEOUT_S = 5.0  # wait for a BROKER_LEAVE reply on closing (without one, the consumer timeout acts)
# An ack answered with one of these did not reach the group's master: it goes again (like one whose
# connection failed) rather than forgetting what it acknowledges.
ACK_AGAIN_CODES = frozenset({ErrorCode.NOT_MASTER, ErrorCode.UNAVAILABLE, ErrorCode.TIMEOUT})
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


@dataclass
class PullSlot:
    """One broker group of a subscription's route and the pull in flight to it, if any (its handle:
    a concurrent Future or an asyncio Task, see `qmq.client.steps.Start`)."""

    group: RouteGroup
    pending: Any = None
    address: str = ""  # where the pull in flight went
    due: float = 0.0  # when its reply is expected at the latest, before PULL_REPLY_GRACE_S (monotonic)
    generation: int = 0  # SubscriptionState.generation(group) when its request was built
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


class AcksInFlight(NamedTuple):
    """A BROKER_ACK put in flight before a pull (see `SubscriptionCore.pull`), checked once done, or
    given up on at `due` (monotonic)."""

    group: str  # the broker group (named by its address when the route is a static list)
    acks: list[list[Any]]
    handle: Any
    due: float


def update_slots(slots: dict[str, PullSlot], route: Route) -> list[RouteGroup]:
    """Add the route's new groups (routes only grow) and take in changed addresses and flags.
    Returns the groups whose master moved (the route names another address first)."""
    moved = []
    for group in route.groups:
        if not group.addresses:
            continue
        slot = slots.get(group.name)
        if slot is None:
            slots[group.name] = PullSlot(group)
        else:
            if slot.group.addresses[0] != group.addresses[0]:
                moved.append(group)
            slot.group = group
    return moved


def pull_retry_delay_s(failures: int) -> float:
    """How long to leave a broker alone after `failures` failed pulls in a row: the first failure
    is retried at once (a lost connection is simply reopened), then the wait doubles."""
    if failures <= 1:
        return 0.0
    return min(PULL_RETRY_MAX_DELAY_S, PULL_RETRY_DELAY_S * 2 ** (failures - 2))


def is_fatal_pull_error(exc: BaseException) -> bool:
    """A pull error that repeating cannot fix: the subscription's own request is refused, or the
    broker's TLS handshake (a setting to fix, like a wrong token)."""
    if isinstance(exc, ConnectFailed):
        return exc.tls_refused
    return isinstance(exc, RemoteError) and exc.code in FATAL_PULL_CODES


class SubscriptionCore:
    """A subscription without I/O; `Subscription` and `AsyncSubscription` are this class with a
    driver, which makes its connections in `_open` and binds the loops below as its methods.

    Thread-safe where the blocking driver needs it: `_lock` guards the state, the buffer and the
    closed flag, so deliveries may be finished from any thread while one pull runs (the driver lets
    one pull run at a time). No step is yielded while the lock is held."""

    def __init__(self, client: ClientCore, options: SubscribeOptions) -> None:
        self.client = client
        self.options = options
        self._state = SubscriptionState(options)
        self._lock = threading.Lock()
        self._slots: dict[str, PullSlot] = {}
        self._buffer: deque[Delivery] = deque()
        self._arrived: list[Arrived] = []  # received, their deliveries not built yet (take_buffered)
        self._last_flush = time.monotonic()
        self._acks_in_flight: list[AcksInFlight] = []
        self._acks_failing: set[str] = set()  # broker groups whose last acks did not get through
        self._closed = False
        self._open()

    def _open(self) -> None:
        """The driver's connections and locks."""
        raise NotImplementedError

    @property
    def subject(self) -> str:
        return self.options.subject

    @property
    def group(self) -> str:
        return self.options.group

    @property
    def consumer(self) -> str:
        return self.options.consumer

    @property
    def closed(self) -> bool:
        with self._lock:
            return self._closed

    # ---- the operations ------------------------------------------------------------------------------

    def pull(self, max: int = DEFAULT_PULL_MAX, wait_s: float = DEFAULT_PULL_WAIT_S) -> Steps[list[Delivery]]:
        """Up to `max` deliveries, waiting up to `wait_s` for the first; [] when none came. Raises
        `ClientError` only when a broker refuses the subscription itself (a bad argument)."""
        if max < 1:
            raise ValueError("max must be at least 1")
        if self.closed:
            raise ClientError("this subscription is closed")
        yield from self._refresh_route()
        if self._flush_due():
            yield from SubscriptionCore.flush(self)  # this class's loop, not a driver's method
        if ready := self.take_buffered(max):
            if self.options.prefetch:
                yield from self._prefetch(max, wait_s)
            return ready
        yield from self._start_acks()  # about to wait: what is finished goes out now, beside the pull
        yield from self._pull_round(max, wait_s)
        if self.options.prefetch:  # before the deliveries are built: the broker works meanwhile
            yield from self._prefetch(max, wait_s, taking=max)
        return self.take_buffered(max)

    def take_buffered(self, max: int = DEFAULT_PULL_MAX) -> list[Delivery]:
        """Deliveries already received and not yet returned by `pull`, without asking any broker for
        more: for a consumer that stops pulling and wants to finish what it was handed."""
        out: list[Delivery] = []
        with self._lock:
            if self._arrived:
                self._buffer.extend(self._state.deliveries(self._arrived))
                self._arrived = []
            while self._buffer and len(out) < max:
                delivery = self._buffer.popleft()
                if self._state.is_current(delivery):  # else its tracker was dropped: it comes again
                    out.append(delivery)
        return out

    def nack(
        self,
        delivery: Delivery,
        delay_s: float = 0.0,
        *,
        dead: bool = False,
        reason: str = "",
        max_attempts: int | None = None,
        stop_key: str | None = None,
    ) -> Steps[tuple[str, Any] | None]:
        """The delivery failed: the broker gives it back to this group after `delay_s` with attempt+1,
        or dead-letters it (`dead`, or its attempt reached `max_attempts`, by default the broker's).
        Returns the broker's outcome, ("retry", due_ms) or ("dead", seq), or None when the nack
        could not be made (the broker then delivers the message again anyway). `stop_key`: with `dead`,
        the ordered key this message stops (`on_poison="stop"`, docs/ordering.md)."""
        with self._lock:
            body = self._state.nack_request(
                delivery, delay_s, dead=dead, reason=reason, max_attempts=max_attempts, stop_key=stop_key
            )
            if not self._state.is_current(delivery):
                return None
        address = self._address(delivery.broker_group)
        reply = yield Call(
            address, RequestCode.BROKER_NACK, self._with_epoch(body, delivery.broker_group), ACK_TIMEOUT_S
        )
        if isinstance(reply, BaseException):
            with self._lock:
                self._state.drop_delivery(delivery)
            log.warning(
                "nack of message %s to %s failed (%s): the broker will deliver it again", delivery.id, address, reply
            )
            return None
        if self._finish(delivery):
            yield from SubscriptionCore.flush(self)
        outcomes = reply.get("outcomes") or [[None, None]]
        return outcomes[0][0], outcomes[0][1]

    def flush(self) -> Steps[None]:
        """Send every acknowledgement made so far, one BROKER_ACK per broker, and wait for the
        answers (of those already in flight too). A broker that cannot take them (lost connection,
        UNKNOWN_CONSUMER) will deliver those messages again."""
        with self._lock:
            acks = self._state.take_acks()
            self._last_flush = time.monotonic()
        if acks:
            groups = list(acks)
            replies = yield Calls(
                [self._call(g, RequestCode.BROKER_ACK, {"acks": acks[g]}, ACK_TIMEOUT_S) for g in groups]
            )
            for group, reply in zip(groups, replies, strict=True):
                self._ack_answered(group, acks[group], reply)
        with self._lock:
            in_flight = [a.handle for a in self._acks_in_flight]
        if in_flight:
            yield WaitAll(in_flight, ACK_TIMEOUT_S + PULL_REPLY_GRACE_S)
            self._settle_acks()

    def heartbeat(self, worker: dict[str, Any] | None = None) -> Steps[None]:
        """Tell every broker this consumer is alive (for handlers slower than the broker's consumer
        timeout, which would otherwise give this consumer's messages to the rest of the group).
        `worker`: what the process reports about itself (host, pid, concurrency, the messages it is
        running), kept by the brokers for `qmq admin inspect`."""
        with self._lock:
            bodies = self._state.heartbeat_requests()
            if worker is not None:  # every broker of the route hears the report, holding messages or not
                for name in self._slots:
                    bodies.setdefault(name, {"consumers": []})
        if worker is not None:
            consumer = self.options.consumer
            bodies = {group: {**body, "consumer": consumer, "worker": worker} for group, body in bodies.items()}
        if not bodies:
            return
        calls = [self._call(g, RequestCode.BROKER_HEARTBEAT, body, ACK_TIMEOUT_S) for g, body in bodies.items()]
        replies = yield Calls(calls)
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, BaseException):
                log.warning("heartbeat to %s failed: %s", call.address, reply)

    def leave(self) -> Steps[int]:
        """On closing, after the last acks: tell the brokers this consumer is going, so that what it
        holds unacknowledged goes back to its group at once rather than after the broker's consumer
        timeout. What the application never got (fetched ahead, or in a reply still on its way) keeps
        its attempt count. Returns how many messages went back; a broker that cannot be told keeps
        them until the timeout, as before."""
        with self._lock:
            not_handed = [(a.tracker.key, a.pull_seq) for a in self._arrived]
            not_handed += [(tracker_key(d), d.pull_seq) for d in self._buffer]
            bodies = self._state.leave_requests(not_handed)
        if not bodies:
            return 0
        calls = [self._call(g, RequestCode.BROKER_LEAVE, body, LEAVE_TIMEOUT_S) for g, body in bodies.items()]
        replies = yield Calls(calls)
        released = 0
        for call, reply in zip(calls, replies, strict=True):
            if isinstance(reply, BaseException):
                log.info(
                    "cannot tell %s this consumer leaves (%s): its messages wait for the timeout", call.address, reply
                )
            else:
                released += int(reply.get("released") or 0)
        return released

    # ---- for the drivers -----------------------------------------------------------------------------

    def set_queues(self, queues: list[int]) -> None:
        """An ordered subscription: the queues its next pulls take from (those whose leases it holds)."""
        with self._lock:
            self._state.queues = sorted(queues)

    def _register(self) -> Steps[None]:
        """Find the route and pull once from every group without waiting: this registers the consumer
        group with every broker, so a message sent after `subscribe` returns reaches a new group.
        Raises `MetaUnreachable`, or `NoRoute` when no broker group carries the subject."""
        route = yield GetRoute(self.subject)
        if isinstance(route, BaseException):
            raise route
        if not route.groups:
            raise no_route_error(self.client.meta, self.subject)
        self._take_route(route)
        yield from self._pull_round(DEFAULT_PULL_MAX, 0.0)

    def _start_acks(self) -> Steps[None]:
        """Put the acknowledgements made so far in flight, one BROKER_ACK per broker, without waiting:
        on one connection the broker reads them before the pull that follows, and journals both in
        one fsync. Their answers are looked at once they came (`_settle_acks`)."""
        self._settle_acks()
        with self._lock:
            acks = self._state.take_acks()
            self._last_flush = time.monotonic()
        for group, entries in acks.items():
            handle = yield Start(self._call(group, RequestCode.BROKER_ACK, {"acks": entries}, ACK_TIMEOUT_S))
            with self._lock:
                self._acks_in_flight.append(AcksInFlight(group, entries, handle, time.monotonic() + ACK_TIMEOUT_S))

    def _address(self, group: str) -> str:
        """Where broker group `group`'s master is now, as the route last said (a static route names
        each group by its broker's address)."""
        slot = self._slots.get(group)
        return slot.group.addresses[0] if slot is not None and slot.group.addresses else group

    def _with_epoch(self, body: dict[str, Any], group: str) -> dict[str, Any]:
        """`body` for broker group `group`, with the group's epoch when replicated."""
        slot = self._slots.get(group)
        return with_epoch(body, slot.group if slot is not None else None)

    def _call(self, group: str, code: RequestCode, body: dict[str, Any], timeout_s: float) -> Call:
        """A request to broker group `group`'s master, with the group's epoch."""
        return Call(self._address(group), code, self._with_epoch(body, group), timeout_s)

    def _settle_acks(self) -> None:
        """Look at the answers of the acknowledgements in flight that came."""
        now = time.monotonic()
        with self._lock:
            over = [a for a in self._acks_in_flight if a.handle.done() or now > a.due]
            self._acks_in_flight = [a for a in self._acks_in_flight if a not in over]
        for sent in over:
            if not sent.handle.done():
                self._ack_answered(sent.group, sent.acks, TimeoutError(f"no reply from broker group {sent.group}"))
            elif not sent.handle.cancelled():
                self._ack_answered(sent.group, sent.acks, outcome(sent.handle))

    def _ack_answered(self, group: str, acks: list[list[Any]], reply: Any) -> None:
        """A refused ack forgets its trackers (the broker delivers those messages again); one that may
        not have arrived goes again with the next acks, to the group's master of the time (after a
        failover, the new one: the pull logs replicate with the group's journal)."""
        if not isinstance(reply, BaseException):
            if group in self._acks_failing:
                self._acks_failing.discard(group)
                log.info("acks reach broker group %s again", group)
            return
        if isinstance(reply, RemoteError) and reply.code not in ACK_AGAIN_CODES:
            with self._lock:
                self._state.drop(group, acks)
            log.warning("broker group %s refused acks (%s): it will deliver those messages again", group, reply)
            return
        with self._lock:
            self._state.ack_again(group, acks)
        if self.client.meta is not None:
            self.client._routes.invalidate([self.subject])  # the group's master may have moved
        if group not in self._acks_failing:  # once per outage: they are tried again with every pull
            self._acks_failing.add(group)
            log.warning("acks to broker group %s did not get through (%s): they go again with the next", group, reply)

    def _finish(self, delivery: Delivery) -> bool:
        """Mark a delivery done (acknowledged, or nacked); True when the acknowledgements are due to go
        out (`flush`)."""
        with self._lock:
            self._state.done(delivery)
        return time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S  # _flush_due(), inline: per message

    def _flush_due(self) -> bool:
        return time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S

    def _mark_closed(self) -> list[Any]:
        """Refuse further pulls; returns the handles of the requests still in flight."""
        with self._lock:
            self._closed = True
            acks = [a.handle for a in self._acks_in_flight]
        return [s.pending for s in self._slots.values() if s.pending is not None] + acks

    # ---- pulling -------------------------------------------------------------------------------------

    def _pull_round(self, max_count: int, wait_s: float) -> Steps[None]:
        """Pull from every group until one has messages (they land in the buffer) or `wait_s` ran
        out. Pulls still waiting at the end stay in flight; their replies are taken next time."""
        deadline = time.monotonic() + wait_s
        first = True
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining > 0 or first:
                yield from self._start_pulls(max_count, max(0.0, remaining), now)
            first = False
            if remaining > 0:
                in_flight = [s.pending for s in self._slots.values() if s.pending is not None]
                if in_flight:
                    yield WaitAny(in_flight, remaining)
                else:  # every group is resting after failures
                    next_try = min((s.retry_at for s in self._slots.values()), default=deadline)
                    yield Sleep(max(0.0, min(deadline, next_try) - now))
            else:  # time is up: collect the replies due by now (pulls made without waiting)
                due = [s.pending for s in self._slots.values() if s.pending is not None and s.due <= now]
                if due:
                    yield WaitAll(due, PULL_REPLY_GRACE_S)
            self._harvest()
            with self._lock:
                if self._buffer or self._arrived or remaining <= 0 or self._closed:
                    return

    def _prefetch(self, max_count: int, wait_s: float, taking: int = 0) -> Steps[None]:
        """Put the next pull in flight to every group that has none, while fewer than `max_count`
        messages would be left held once this pull hands out `taking` (so at most about two pulls'
        worth is held ahead)."""
        with self._lock:
            if self._closed or len(self._buffer) + len(self._arrived) - taking >= max_count:
                return
        yield from self._start_pulls(max_count, wait_s, time.monotonic())

    def _start_pulls(self, max_count: int, wait_s: float, now: float) -> Steps[None]:
        for slot in self._slots.values():
            if not slot.can_pull(now):
                continue
            address, name = slot.group.addresses[0], slot.group.name
            with self._lock:
                body = with_epoch(self._state.pull_request(name, max_count, wait_s), slot.group)
                generation = self._state.generation(name)
            handle = yield Start(Call(address, RequestCode.BROKER_PULL, body, wait_s + PULL_REPLY_GRACE_S))
            slot.sent(handle, address, now + wait_s, generation)

    def _harvest(self) -> None:
        """Take the replies of finished pulls into the buffer; note failures for back-off."""
        self._settle_acks()
        fatal: BaseException | None = None
        now = time.monotonic()
        for slot in self._slots.values():
            handle = slot.pending
            if handle is None:
                continue
            if handle.done():
                if handle.cancelled():  # closed meanwhile
                    slot.pending = None
                    continue
                reply = outcome(handle)
            elif now > slot.due + PULL_REPLY_GRACE_S:  # a reply that never came (a driver may not time out)
                reply = TimeoutError(f"no reply from {slot.address} within {PULL_REPLY_GRACE_S:g} s of its wait")
            else:
                continue
            slot.pending = None
            if isinstance(reply, BaseException):
                self.client._routes.invalidate([self.subject])  # the group's master may have moved
                if is_fatal_pull_error(reply):
                    fatal = reply
                elif slot.failed(now):
                    log.warning(
                        "cannot pull %s from broker group %s at %s: %s; retrying",
                        self.subject,
                        slot.group.name,
                        slot.address,
                        reply,
                    )
                continue
            if slot.succeeded():
                log.info("pulling %s from broker group %s again", self.subject, slot.group.name)
            with self._lock:
                self._arrived.extend(self._state.receive(slot.group.name, reply, slot.generation, slot.address))
        if fatal is not None:
            raise ClientError(f"the broker refused to serve {self.subject!r} to group {self.group!r}: {fatal}")

    def _refresh_route(self) -> Steps[None]:
        """Take in the route's new groups (without a meta server the route never changes)."""
        if self.client.meta is None:
            return
        route = yield GetRoute(self.subject)
        if isinstance(route, BaseException):
            log.warning("keeping the route of %s: %s", self.subject, route)
            return
        self._take_route(route)

    def _take_route(self, route: Route) -> None:
        """The route's groups as pull slots; a group whose master moved holds its acks until the new
        master answers a pull (`SubscriptionState.master_moved`)."""
        for group in update_slots(self._slots, route):
            with self._lock:
                self._state.master_moved(group.name, group.addresses[0])
