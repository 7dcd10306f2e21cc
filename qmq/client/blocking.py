"""The blocking client: send messages and consume them from code without an event loop.

    client = Client(meta="127.0.0.1:20880")            # or Client(brokers=["127.0.0.1:20881"])
    results = client.send([OutgoingMessage("order.created", {"id": 7}, key="7")])
    with client.subscribe("order.created", "billing") as subscription:
        for delivery in subscription.pull():
            handle(delivery)
            subscription.ack(delivery)

Promises: `send` returns one `SendResult` per message, in order, and never raises for a message
that could not be sent (`send_one` does, with `SendError`); a message that failed on one broker
group is offered to another with the same id. A subscription never raises for a lost broker or a
refused acknowledgement: it forgets what that broker handed out and the broker delivers it again.
Both are thread-safe; one `Subscription` may be acknowledged from many threads while one pulls.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from datetime import datetime
from typing import Any

from qmq.client.core import (
    ACK_FLUSH_INTERVAL_S,
    ACK_TIMEOUT_S,
    CANCEL_TIMEOUT_S,
    DEFAULT_BATCH_SIZE,
    DEFAULT_PULL_MAX,
    DEFAULT_PULL_WAIT_S,
    PULL_REPLY_GRACE_S,
    SEND_TIMEOUT_S,
    ClientError,
    Delivery,
    GroupHealth,
    MetaUnreachable,
    NoRoute,
    OutgoingMessage,
    PullSlot,
    SendBatch,
    SendError,
    SendJob,
    SendResult,
    SubscribeOptions,
    SubscriptionState,
    default_consumer_id,
    is_fatal_pull_error,
    merge_cancel_outcomes,
    update_slots,
)
from qmq.client.pool import ConnectFailed, ConnectionPool
from qmq.client.routes import (
    DEFAULT_META_ADDRESS,
    META_RETRY_S,
    META_TIMEOUT_S,
    Route,
    RouteCache,
    listed_delay_servers,
    parse_address,
    parse_route,
    route_request,
    static_route,
    with_delay_servers,
)
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError

log = logging.getLogger("qmq.client")

META_ENV = "QMQ_META"
SEND_THREADS = 16  # BROKER_SEND requests in flight at once for one send() call
MAX_PULL_THREADS = 16  # broker groups a subscription long-polls at once


def resolve_servers(meta: str | None, brokers: Sequence[str] | None) -> tuple[str | None, tuple[str, ...]]:
    """Either a meta server or broker addresses; neither means `$QMQ_META`, else the default meta
    address. Addresses are checked here, so a typo is named before anything is sent."""
    if meta and brokers:
        raise ValueError("give a meta server or broker addresses, not both")
    if brokers:
        for address in brokers:
            parse_address(address)
        return None, tuple(brokers)
    meta = meta or os.environ.get(META_ENV) or DEFAULT_META_ADDRESS
    parse_address(meta)
    return meta, ()


def resolve_delay_servers(delay_servers: Sequence[str] | None) -> tuple[str, ...]:
    """Delay server addresses given directly (they take precedence over the meta server's)."""
    for address in delay_servers or ():
        parse_address(address)
    return tuple(delay_servers or ())


def static_delay_addresses(meta: str | None, delay_servers: Sequence[str]) -> list[str] | None:
    """The delay servers to ask without the meta server, or None when the meta server must say."""
    if delay_servers:
        return list(delay_servers)
    if meta is None:
        raise ClientError("no delay server is known: give delay_servers=[...] or a meta server")
    return None


def listed_delay_addresses(meta: str, reply: dict[str, Any] | BaseException) -> list[str]:
    """The available delay servers in a META_LIST reply, or the error that stood in its way."""
    if isinstance(reply, BaseException):
        raise MetaUnreachable(f"cannot ask the meta server at {meta} for delay servers: {reply}")
    addresses = listed_delay_servers(reply)
    if not addresses:
        raise ClientError(f"the meta server at {meta} knows no available delay server")
    return addresses


def cancel_failed(address: str, exc: BaseException) -> ClientError:
    return ClientError(
        f"cancel not confirmed by delay server {address} ({exc}); the message may be there: "
        "cancel again (cancelling twice is harmless)"
    )


class Client:
    """A producer and the factory of subscriptions, over one pool of connections."""

    def __init__(
        self,
        meta: str | None = None,
        brokers: Sequence[str] | None = None,
        token: str | None = None,
        client_id: str | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        send_timeout_s: float = SEND_TIMEOUT_S,
        delay_servers: Sequence[str] | None = None,
    ) -> None:
        self.meta, self.brokers = resolve_servers(meta, brokers)
        self.delay_servers = resolve_delay_servers(delay_servers)
        self.token = token
        self.client_id = client_id
        self.batch_size = batch_size
        self.send_timeout_s = send_timeout_s
        self._pool = ConnectionPool(client_id=client_id, token=token)
        self._routes = RouteCache()
        self._health = GroupHealth()
        self._health_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()
        self._subscriptions: weakref.WeakSet[Subscription] = weakref.WeakSet()

    # ---- routes ----------------------------------------------------------------------------------

    def route(self, subject: str, *, refresh: bool = False) -> Route:
        """The broker groups of `subject`, from the cache while it is fresh. Raises `MetaUnreachable`
        when the meta server cannot answer and no route was ever cached."""
        if self.meta is None:
            return static_route(subject, self.brokers, self.delay_servers)
        now = time.monotonic()
        if not refresh and (route := self._routes.fresh(subject, now)) is not None:
            return route
        try:
            reply = self._pool.request(self.meta, RequestCode.META_ROUTE, route_request(subject), META_TIMEOUT_S)
        except (RemoteError, OSError) as exc:
            error = meta_error(self.meta, subject, exc)
            stale = self._routes.stale(subject)
            if stale is None:
                raise error from None
            log.warning("%s; using the route fetched before", error)
            self._routes.put(stale, now, META_RETRY_S)
            return stale
        route = with_delay_servers(parse_route(subject, reply), self.delay_servers)
        self._routes.put(route, now)
        return route

    # ---- sending ---------------------------------------------------------------------------------

    def send(self, messages: Iterable[OutgoingMessage]) -> list[SendResult]:
        """Send messages; one result per message, in order. Batches go out in parallel, one
        BROKER_SEND per group per `batch_size` messages."""
        job = SendJob(list(messages), batch_size=self.batch_size)
        refresh: set[str] = set()
        while not job.done:
            routes: dict[str, Route] = {}
            for subject in job.pending_subjects():
                try:
                    routes[subject] = self.route(subject, refresh=subject in refresh)
                except MetaUnreachable as exc:
                    job.fail_subject(subject, ErrorCode.UNAVAILABLE, str(exc))
            with self._health_lock:
                batches = job.plan(routes, self._health, time.monotonic())
            if not batches:
                continue
            if job.retry_delay_s:
                time.sleep(job.retry_delay_s)  # every group left already failed these messages once
            refresh = set()
            for batch, outcome in zip(batches, self._send_batches(batches), strict=True):
                if isinstance(outcome, BaseException):
                    if job.on_error(batch, outcome):
                        log.warning(
                            "send to broker group %s failed (%s); offering its messages again", batch.group, outcome
                        )
                        with self._health_lock:
                            self._health.failed(batch.group, time.monotonic())
                        refresh |= {job.messages[i].subject for i in batch.indices}
                else:
                    job.on_reply(batch, outcome)
                    with self._health_lock:
                        self._health.succeeded(batch.group)
            if self.meta is not None:
                self._routes.invalidate(refresh)
        return job.results()

    def send_one(
        self,
        subject: str,
        body: Any,
        *,
        key: str | None = None,
        tags: Sequence[str] = (),
        headers: Mapping[str, str] | None = None,
        message_id: str | None = None,
        deliver_at: datetime | int | None = None,
    ) -> SendResult:
        """Send one message; raises `SendError` if it was rejected or no group accepted it."""
        message = OutgoingMessage(
            subject,
            body,
            key=key,
            tags=tuple(tags),
            headers=headers,
            deliver_at=deliver_at,
            **({"id": message_id} if message_id else {}),
        )
        result = self.send([message])[0]
        if not result.ok:
            raise SendError(result)
        return result

    def _send_batches(self, batches: list[SendBatch]) -> list[dict[str, Any] | BaseException]:
        if len(batches) == 1:
            return [self._send_batch(batches[0])]
        futures = [self._send_executor().submit(self._send_batch, batch) for batch in batches]
        return [future.result() for future in futures]

    def _send_batch(self, batch: SendBatch) -> dict[str, Any] | BaseException:
        """The reply, or the exception that stood in its way (returned, not raised)."""
        try:
            return self._pool.get(batch.addresses[0]).request(batch.code, batch.body, self.send_timeout_s)
        except Exception as exc:
            return exc

    def cancel(self, message_ids: Iterable[str]) -> dict[str, str]:
        """Cancel delayed messages by id. Every delay server is asked (the message is on one of
        them); the outcome per id is "cancelled" (it will never be delivered), "too_late" (it was
        due already: delivered, or being delivered) or "unknown" (no delay server knows it; docs/delay.md).
        Raises `ClientError` when a delay server could not be asked."""
        ids = list(message_ids)
        if not ids:
            return {}
        addresses = static_delay_addresses(self.meta, self.delay_servers)
        if addresses is None:
            assert self.meta is not None
            try:
                listing: dict[str, Any] | BaseException = self._pool.request(
                    self.meta, RequestCode.META_LIST, {}, META_TIMEOUT_S
                )
            except (RemoteError, OSError) as exc:
                listing = exc
            addresses = listed_delay_addresses(self.meta, listing)
        replies = []
        for address in addresses:
            try:
                replies.append(self._pool.request(address, RequestCode.DELAY_CANCEL, {"ids": ids}, CANCEL_TIMEOUT_S))
            except (RemoteError, OSError) as exc:
                raise cancel_failed(address, exc) from None
        return merge_cancel_outcomes(ids, replies)

    def _send_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix="qmq-send")
            return self._executor

    # ---- consuming -------------------------------------------------------------------------------

    def subscribe(
        self,
        subject: str,
        group: str,
        *,
        consumer: str | None = None,
        tags: Sequence[str] = (),
        match_all: bool = False,
        broadcast: bool = False,
        start: str = "latest",
    ) -> Subscription:
        """Consume `subject` as consumer group `group` from every broker group of its route.

        `tags`: only messages with one of them (all of them with `match_all`). `broadcast`: this
        consumer gets every message, with its own position. `start`: where a group new to a broker
        begins, "latest" (messages stored from now on) or "earliest" (all still stored). The
        subscription registers with every broker before returning, so a message sent after
        `subscribe` returns reaches a new group. Raises ValueError for a bad argument,
        `MetaUnreachable`, or `NoRoute` when no broker group carries the subject."""
        options = SubscribeOptions(
            subject, group, consumer or default_consumer_id(), tuple(tags), match_all, broadcast, start
        )
        subscription = Subscription(self, options)
        self._subscriptions.add(subscription)
        return subscription

    def close(self) -> None:
        """Close every subscription (flushing its acks) and every connection."""
        for subscription in list(self._subscriptions):
            subscription.close()
        self._pool.close()
        with self._executor_lock:
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def meta_error(meta: str, subject: str, exc: BaseException) -> MetaUnreachable:
    if isinstance(exc, RemoteError):
        return MetaUnreachable(f"the meta server at {meta} could not give a route for {subject!r}: {exc}")
    reason = exc.reason if isinstance(exc, ConnectFailed) else str(exc)
    return MetaUnreachable(f"cannot reach the meta server at {meta}: {reason}")


def no_route_error(client_meta: str | None, subject: str) -> NoRoute:
    where = f"the meta server at {client_meta}" if client_meta else "the broker list"
    return NoRoute(f"no broker group carries subject {subject!r} ({where} knows none: are brokers running?)")


class Subscription:
    """Made by `Client.subscribe`. Pulls long-poll every broker group of the route at once: a pull
    returns as soon as any group has messages, and the groups still waiting stay in flight for the
    next call. It has its own connections, so that a broker closing one (after an ack it could not
    match) cuts only this subscription's requests.

    Deliveries pulled but never acknowledged (the process stopped) go back to the group once the
    broker's consumer timeout passes; `close()` flushes the acknowledgements made so far."""

    def __init__(self, client: Client, options: SubscribeOptions) -> None:
        self.client = client
        self.options = options
        self._state = SubscriptionState(options)
        self._lock = threading.Lock()  # guards _state, _buffer, _closed
        self._pull_lock = threading.Lock()  # one pull() at a time
        self._pool = ConnectionPool(client_id=client.client_id, token=client.token)
        self._executor = ThreadPoolExecutor(max_workers=MAX_PULL_THREADS, thread_name_prefix="qmq-pull")
        self._slots: dict[str, PullSlot] = {}
        self._buffer: deque[Delivery] = deque()
        self._last_flush = time.monotonic()
        self._closed = False
        self._wakeup = threading.Event()
        try:
            route = client.route(options.subject)
            if not route.groups:
                raise no_route_error(client.meta, options.subject)
            update_slots(self._slots, route)
            self._pull_round(DEFAULT_PULL_MAX, 0.0)  # registers the group with every broker now
        except BaseException:
            self._shutdown()
            raise

    @property
    def subject(self) -> str:
        return self.options.subject

    @property
    def group(self) -> str:
        return self.options.group

    @property
    def consumer(self) -> str:
        return self.options.consumer

    def pull(self, max: int = DEFAULT_PULL_MAX, wait_s: float = DEFAULT_PULL_WAIT_S) -> list[Delivery]:
        """Up to `max` deliveries, waiting up to `wait_s` for the first; [] when none came. Raises
        `ClientError` only when a broker refuses the subscription itself (a bad argument)."""
        if max < 1:
            raise ValueError("max must be at least 1")
        with self._pull_lock:
            self._check_open()
            self._refresh_route()
            if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
                self.flush()
            if ready := self._take_buffered(max):
                return ready
            self.flush()  # about to wait: send what is finished now rather than after the wait
            self._pull_round(max, wait_s)
            return self._take_buffered(max)

    def take_buffered(self, max: int = DEFAULT_PULL_MAX) -> list[Delivery]:
        """Deliveries already received and not yet returned by `pull`, without asking any broker for
        more: for a consumer that stops pulling and wants to finish what it was handed."""
        return self._take_buffered(max)

    def ack(self, delivery: Delivery) -> None:
        """Mark a delivery done. Acknowledgements go out in batches: on `flush()`, before a pull
        waits, and at least every ACK_FLUSH_INTERVAL_S while pull or ack is called."""
        with self._lock:
            self._state.done(delivery)
        if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
            self.flush()

    def nack(
        self,
        delivery: Delivery,
        delay_s: float = 0.0,
        *,
        dead: bool = False,
        reason: str = "",
        max_attempts: int | None = None,
    ) -> tuple[str, Any] | None:
        """The delivery failed: the broker gives it back to this group after `delay_s` with attempt+1,
        or dead-letters it (`dead`, or its attempt reached `max_attempts`, by default the broker's).
        Returns the broker's outcome, ("retry", due_ms) or ("dead", seq), or None when the nack
        could not be made (the broker then delivers the message again anyway)."""
        with self._lock:
            body = self._state.nack_request(delivery, delay_s, dead=dead, reason=reason, max_attempts=max_attempts)
            if not self._state.is_current(delivery):
                return None
        try:
            reply = self._pool.request(delivery.broker, RequestCode.BROKER_NACK, body, ACK_TIMEOUT_S)
        except Exception as exc:
            with self._lock:
                self._state.drop_delivery(delivery)
            log.warning(
                "nack of message %s to %s failed (%s): the broker will deliver it again",
                delivery.id,
                delivery.broker,
                exc,
            )
            return None
        with self._lock:
            self._state.done(delivery)
        if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
            self.flush()
        outcomes = reply.get("outcomes") or [[None, None]]
        return outcomes[0][0], outcomes[0][1]

    def flush(self) -> None:
        """Send every acknowledgement made so far, one BROKER_ACK per broker. A broker that cannot
        take them (lost connection, UNKNOWN_CONSUMER) will deliver those messages again."""
        with self._lock:
            acks = self._state.take_acks()
            self._last_flush = time.monotonic()
        for address, entries in acks.items():
            try:
                self._pool.request(address, RequestCode.BROKER_ACK, {"acks": entries}, ACK_TIMEOUT_S)
            except Exception as exc:
                with self._lock:
                    self._state.drop(address, entries)
                log.warning("acks to %s failed (%s): the broker will deliver the messages again", address, exc)

    def heartbeat(self) -> None:
        """Tell every broker this consumer is alive (for handlers slower than the broker's consumer
        timeout, which would otherwise give this consumer's messages to the rest of the group)."""
        with self._lock:
            requests = self._state.heartbeat_requests()
        for address, body in requests.items():
            try:
                self._pool.request(address, RequestCode.BROKER_HEARTBEAT, body, ACK_TIMEOUT_S)
            except Exception as exc:
                log.warning("heartbeat to %s failed: %s", address, exc)

    def close(self) -> None:
        """Flush acknowledgements and close this subscription's connections. Idempotent."""
        with self._lock:
            if self._closed:
                return
        try:
            self.flush()
        finally:
            self._shutdown()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # ---- pulling ---------------------------------------------------------------------------------

    def _pull_round(self, max_count: int, wait_s: float) -> None:
        """Pull from every group until one has messages (they land in the buffer) or `wait_s` ran
        out. Pulls still waiting at the end stay in flight; their replies are taken next time."""
        deadline = time.monotonic() + wait_s
        first = True
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining > 0 or first:
                self._start_pulls(max_count, max(0.0, remaining), now)
            first = False
            if remaining > 0:
                in_flight = [s.pending for s in self._slots.values() if s.pending is not None]
                if in_flight:
                    wait(in_flight, timeout=remaining, return_when=FIRST_COMPLETED)
                else:  # every group is resting after failures
                    next_try = min((s.retry_at for s in self._slots.values()), default=deadline)
                    self._wakeup.wait(max(0.0, min(deadline, next_try) - now))
            else:  # time is up: collect the replies due by now (pulls made without waiting)
                due = [s.pending for s in self._slots.values() if s.pending is not None and s.due <= now]
                if due:
                    wait(due, timeout=PULL_REPLY_GRACE_S)
            self._harvest()
            with self._lock:
                if self._buffer or remaining <= 0 or self._closed:
                    return

    def _start_pulls(self, max_count: int, wait_s: float, now: float) -> None:
        for slot in self._slots.values():
            if not slot.can_pull(now):
                continue
            address = slot.group.addresses[0]
            with self._lock:
                body = self._state.pull_request(address, max_count, wait_s)
                generation = self._state.generation(address)
            future = self._executor.submit(
                self._pool.request, address, RequestCode.BROKER_PULL, body, wait_s + PULL_REPLY_GRACE_S
            )
            slot.sent(future, address, now + wait_s, generation)

    def _harvest(self) -> None:
        """Take the replies of finished pulls into the buffer; note failures for back-off."""
        fatal: BaseException | None = None
        for slot in self._slots.values():
            if slot.pending is None or not slot.pending.done():
                continue
            future, slot.pending = slot.pending, None
            if future.cancelled():  # closed meanwhile
                continue
            try:
                reply = future.result()
            except Exception as exc:
                if is_fatal_pull_error(exc):
                    fatal = exc
                elif slot.failed(time.monotonic()):
                    log.warning(
                        "cannot pull %s from broker group %s at %s: %s; retrying",
                        self.subject,
                        slot.group.name,
                        slot.address,
                        exc,
                    )
                continue
            if slot.succeeded():
                log.info("pulling %s from broker group %s again", self.subject, slot.group.name)
            with self._lock:
                self._buffer.extend(self._state.accept(slot.address, reply, slot.generation))
        if fatal is not None:
            raise ClientError(f"the broker refused to serve {self.subject!r} to group {self.group!r}: {fatal}")

    def _take_buffered(self, max_count: int) -> list[Delivery]:
        out: list[Delivery] = []
        with self._lock:
            while self._buffer and len(out) < max_count:
                delivery = self._buffer.popleft()
                if self._state.is_current(delivery):  # else its tracker was dropped: it comes again
                    out.append(delivery)
        return out

    def _refresh_route(self) -> None:
        if self.client.meta is None:
            return
        try:
            update_slots(self._slots, self.client.route(self.subject))
        except ClientError as exc:
            log.warning("keeping the route of %s: %s", self.subject, exc)

    def _check_open(self) -> None:
        with self._lock:
            if self._closed:
                raise ClientError("this subscription is closed")

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._wakeup.set()
        self._pool.close()  # fails the pulls in flight at once
        self._executor.shutdown(wait=False, cancel_futures=True)
