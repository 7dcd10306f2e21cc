"""The asyncio client: the blocking client's API and promises, for code on an event loop (the delay
server sends with it).

    async with AsyncClient(meta="127.0.0.1:20880") as client:
        results = await client.send([OutgoingMessage("order.created", {"id": 7})])
        subscription = await client.subscribe("order.created", "billing")
        for delivery in await subscription.pull():
            await subscription.ack(delivery)

The decisions (batching, group choice, retries, ack prefixes) are the core's (`qmq.client.core`),
the same as the blocking client's; only the waiting differs. Use one client from one event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from qmq.client.blocking import (
    cancel_failed,
    listed_delay_addresses,
    meta_error,
    no_route_error,
    resolve_delay_servers,
    resolve_servers,
    static_delay_addresses,
)
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
from qmq.client.pool import AsyncConnectionPool
from qmq.client.routes import (
    META_RETRY_S,
    META_TIMEOUT_S,
    Route,
    RouteCache,
    parse_route,
    route_request,
    static_route,
    with_delay_servers,
)
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError

log = logging.getLogger("qmq.client")

__all__ = ["AsyncClient", "AsyncSubscription"]

MAX_SENDS_IN_FLIGHT = 16  # BROKER_SEND requests in flight at once for one client


class AsyncClient:
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
        self._pool = AsyncConnectionPool(client_id=client_id, token=token)
        self._routes = RouteCache()
        self._health = GroupHealth()
        self._sends = asyncio.Semaphore(MAX_SENDS_IN_FLIGHT)
        self._subscriptions: weakref.WeakSet[AsyncSubscription] = weakref.WeakSet()

    async def route(self, subject: str, *, refresh: bool = False) -> Route:
        """The broker groups of `subject` (see `Client.route`)."""
        if self.meta is None:
            return static_route(subject, self.brokers, self.delay_servers)
        now = time.monotonic()
        if not refresh and (route := self._routes.fresh(subject, now)) is not None:
            return route
        try:
            reply = await self._pool.request(self.meta, RequestCode.META_ROUTE, route_request(subject), META_TIMEOUT_S)
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

    async def send(self, messages: Iterable[OutgoingMessage]) -> list[SendResult]:
        """Send messages; one result per message, in order (see `Client.send`)."""
        job = SendJob(list(messages), batch_size=self.batch_size)
        refresh: set[str] = set()
        while not job.done:
            routes: dict[str, Route] = {}
            for subject in job.pending_subjects():
                try:
                    routes[subject] = await self.route(subject, refresh=subject in refresh)
                except MetaUnreachable as exc:
                    job.fail_subject(subject, ErrorCode.UNAVAILABLE, str(exc))
            batches = job.plan(routes, self._health, time.monotonic())
            if not batches:
                continue
            if job.retry_delay_s:
                await asyncio.sleep(job.retry_delay_s)  # every group left already failed these messages once
            refresh = set()
            outcomes = await asyncio.gather(*(self._send_batch(batch) for batch in batches))
            for batch, outcome in zip(batches, outcomes, strict=True):
                if isinstance(outcome, BaseException):
                    if job.on_error(batch, outcome):
                        log.warning(
                            "send to broker group %s failed (%s); offering its messages again", batch.group, outcome
                        )
                        self._health.failed(batch.group, time.monotonic())
                        refresh |= {job.messages[i].subject for i in batch.indices}
                else:
                    job.on_reply(batch, outcome)
                    self._health.succeeded(batch.group)
            if self.meta is not None:
                self._routes.invalidate(refresh)
        return job.results()

    async def send_one(
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
        result = (await self.send([message]))[0]
        if not result.ok:
            raise SendError(result)
        return result

    async def cancel(self, message_ids: Iterable[str]) -> dict[str, str]:
        """Cancel delayed messages by id (see `Client.cancel`)."""
        ids = list(message_ids)
        if not ids:
            return {}
        addresses = static_delay_addresses(self.meta, self.delay_servers)
        if addresses is None:
            assert self.meta is not None
            try:
                listing: dict[str, Any] | BaseException = await self._pool.request(
                    self.meta, RequestCode.META_LIST, {}, META_TIMEOUT_S
                )
            except (RemoteError, OSError) as exc:
                listing = exc
            addresses = listed_delay_addresses(self.meta, listing)
        replies = await asyncio.gather(
            *(self._pool.request(a, RequestCode.DELAY_CANCEL, {"ids": ids}, CANCEL_TIMEOUT_S) for a in addresses),
            return_exceptions=True,
        )
        for address, reply in zip(addresses, replies, strict=True):
            if isinstance(reply, BaseException):
                raise cancel_failed(address, reply) from None
        return merge_cancel_outcomes(ids, replies)

    async def _send_batch(self, batch: SendBatch) -> dict[str, Any] | BaseException:
        """The reply, or the exception that stood in its way (returned, not raised)."""
        async with self._sends:
            try:
                conn = await self._pool.get(batch.addresses[0])
                return await conn.request(batch.code, batch.body, self.send_timeout_s)
            except Exception as exc:
                return exc

    async def subscribe(
        self,
        subject: str,
        group: str,
        *,
        consumer: str | None = None,
        tags: Sequence[str] = (),
        match_all: bool = False,
        broadcast: bool = False,
        start: str = "latest",
    ) -> AsyncSubscription:
        """Consume `subject` as consumer group `group` (see `Client.subscribe`)."""
        options = SubscribeOptions(
            subject, group, consumer or default_consumer_id(), tuple(tags), match_all, broadcast, start
        )
        subscription = AsyncSubscription(self, options)
        await subscription._start()
        self._subscriptions.add(subscription)
        return subscription

    async def close(self) -> None:
        """Close every subscription (flushing its acks) and every connection."""
        for subscription in list(self._subscriptions):
            await subscription.close()
        await self._pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class AsyncSubscription:
    """Made by `AsyncClient.subscribe`; see the blocking `Subscription` for what it promises."""

    def __init__(self, client: AsyncClient, options: SubscribeOptions) -> None:
        self.client = client
        self.options = options
        self._state = SubscriptionState(options)
        self._pull_lock = asyncio.Lock()  # one pull() at a time
        self._pool = AsyncConnectionPool(client_id=client.client_id, token=client.token)
        self._slots: dict[str, PullSlot] = {}
        self._buffer: deque[Delivery] = deque()
        self._last_flush = time.monotonic()
        self._closed = False

    async def _start(self) -> None:
        try:
            route = await self.client.route(self.options.subject)
            if not route.groups:
                raise no_route_error(self.client.meta, self.options.subject)
            update_slots(self._slots, route)
            await self._pull_round(DEFAULT_PULL_MAX, 0.0)  # registers the group with every broker now
        except BaseException:
            await self._shutdown()
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

    async def pull(self, max: int = DEFAULT_PULL_MAX, wait_s: float = DEFAULT_PULL_WAIT_S) -> list[Delivery]:
        """Up to `max` deliveries, waiting up to `wait_s` for the first; [] when none came."""
        if max < 1:
            raise ValueError("max must be at least 1")
        async with self._pull_lock:
            if self._closed:
                raise ClientError("this subscription is closed")
            await self._refresh_route()
            if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
                await self.flush()
            if ready := self._take_buffered(max):
                return ready
            await self.flush()  # about to wait: send what is finished now rather than after the wait
            await self._pull_round(max, wait_s)
            return self._take_buffered(max)

    async def ack(self, delivery: Delivery) -> None:
        """Mark a delivery done; acknowledgements go out in batches (see `Subscription.ack`)."""
        self._state.done(delivery)
        if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
            await self.flush()

    async def nack(
        self,
        delivery: Delivery,
        delay_s: float = 0.0,
        *,
        dead: bool = False,
        reason: str = "",
        max_attempts: int | None = None,
    ) -> tuple[str, Any] | None:
        """The delivery failed: retry it after `delay_s`, or dead-letter it (see `Subscription.nack`)."""
        body = self._state.nack_request(delivery, delay_s, dead=dead, reason=reason, max_attempts=max_attempts)
        if not self._state.is_current(delivery):
            return None
        try:
            reply = await self._pool.request(delivery.broker, RequestCode.BROKER_NACK, body, ACK_TIMEOUT_S)
        except Exception as exc:
            self._state.drop_delivery(delivery)
            log.warning(
                "nack of message %s to %s failed (%s): the broker will deliver it again",
                delivery.id,
                delivery.broker,
                exc,
            )
            return None
        self._state.done(delivery)
        if time.monotonic() - self._last_flush >= ACK_FLUSH_INTERVAL_S:
            await self.flush()
        outcomes = reply.get("outcomes") or [[None, None]]
        return outcomes[0][0], outcomes[0][1]

    async def flush(self) -> None:
        """Send every acknowledgement made so far, one BROKER_ACK per broker, in parallel."""
        acks = self._state.take_acks()
        self._last_flush = time.monotonic()
        if acks:
            await asyncio.gather(*(self._send_acks(address, entries) for address, entries in acks.items()))

    async def _send_acks(self, address: str, entries: list[list[Any]]) -> None:
        try:
            await self._pool.request(address, RequestCode.BROKER_ACK, {"acks": entries}, ACK_TIMEOUT_S)
        except Exception as exc:
            self._state.drop(address, entries)
            log.warning("acks to %s failed (%s): the broker will deliver the messages again", address, exc)

    async def heartbeat(self) -> None:
        """Tell every broker this consumer is alive (see `Subscription.heartbeat`)."""
        for address, body in self._state.heartbeat_requests().items():
            try:
                await self._pool.request(address, RequestCode.BROKER_HEARTBEAT, body, ACK_TIMEOUT_S)
            except Exception as exc:
                log.warning("heartbeat to %s failed: %s", address, exc)

    async def close(self) -> None:
        """Flush acknowledgements and close this subscription's connections. Idempotent."""
        if self._closed:
            return
        try:
            await self.flush()
        finally:
            await self._shutdown()

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # ---- pulling ---------------------------------------------------------------------------------

    async def _pull_round(self, max_count: int, wait_s: float) -> None:
        """Pull from every group until one has messages or `wait_s` ran out (see the blocking
        `Subscription._pull_round`)."""
        loop = asyncio.get_running_loop()
        deadline = time.monotonic() + wait_s
        first = True
        while True:
            now = time.monotonic()
            remaining = deadline - now
            if remaining > 0 or first:
                self._start_pulls(loop, max_count, max(0.0, remaining), now)
            first = False
            if remaining > 0:
                in_flight = [s.pending for s in self._slots.values() if s.pending is not None]
                if in_flight:
                    await asyncio.wait(in_flight, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
                else:  # every group is resting after failures
                    next_try = min((s.retry_at for s in self._slots.values()), default=deadline)
                    await asyncio.sleep(max(0.0, min(deadline, next_try) - now))
            else:
                due = [s.pending for s in self._slots.values() if s.pending is not None and s.due <= now]
                if due:
                    await asyncio.wait(due, timeout=PULL_REPLY_GRACE_S)
            self._harvest()
            if self._buffer or remaining <= 0 or self._closed:
                return

    def _start_pulls(self, loop: asyncio.AbstractEventLoop, max_count: int, wait_s: float, now: float) -> None:
        for slot in self._slots.values():
            if not slot.can_pull(now):
                continue
            address = slot.group.addresses[0]
            body = self._state.pull_request(address, max_count, wait_s)
            task = loop.create_task(
                self._pool.request(address, RequestCode.BROKER_PULL, body, wait_s + PULL_REPLY_GRACE_S)
            )
            slot.sent(task, address, now + wait_s, self._state.generation(address))

    def _harvest(self) -> None:
        fatal: BaseException | None = None
        for slot in self._slots.values():
            if slot.pending is None or not slot.pending.done():
                continue
            task, slot.pending = slot.pending, None
            exc = task.exception() if not task.cancelled() else asyncio.CancelledError()
            if exc is not None:
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
            self._buffer.extend(self._state.accept(slot.address, task.result(), slot.generation))
        if fatal is not None:
            raise ClientError(f"the broker refused to serve {self.subject!r} to group {self.group!r}: {fatal}")

    def _take_buffered(self, max_count: int) -> list[Delivery]:
        out: list[Delivery] = []
        while self._buffer and len(out) < max_count:
            delivery = self._buffer.popleft()
            if self._state.is_current(delivery):  # else its tracker was dropped: it comes again
                out.append(delivery)
        return out

    async def _refresh_route(self) -> None:
        if self.client.meta is None:
            return
        try:
            update_slots(self._slots, await self.client.route(self.subject))
        except ClientError as exc:
            log.warning("keeping the route of %s: %s", self.subject, exc)

    async def _shutdown(self) -> None:
        self._closed = True
        tasks = [s.pending for s in self._slots.values() if s.pending is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._pool.close()
