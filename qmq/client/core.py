"""The client's core: its settings and operations without I/O, shared by both drivers.

`ClientCore` checks the settings and states each operation once, as a loop of steps
(`qmq.client.steps`): `Client` (blocking, threads) and `AsyncClient` (asyncio) are this class with a
driver that binds each loop as a method which runs it (`send = blocking(ClientCore.send)`). The
decisions live beside it, one concern a module: `routes` (which groups carry a subject), `sending`
(the send loop, group choice, retries), `messages` (what is sent, checked as a broker checks it),
`deliveries` and `consuming` (subscriptions), `errors`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from qmq.client import ordering, sending
from qmq.client.deliveries import (
    SubscribeOptions,
    default_consumer_id,
)
from qmq.client.messages import OutgoingMessage, SendError, SendResult
from qmq.client.routes import Route, RouteBook, resolve_delay_servers, resolve_servers
from qmq.client.sending import (
    DEFAULT_BATCH_SIZE,
    DELIVERY_TIMEOUT_S,
    SEND_TIMEOUT_S,
    GroupHealth,
)
from qmq.client.steps import Steps, Subscribe

__all__ = ["CLIENT_OPERATIONS", "ClientCore"]

# The operations of ClientCore, which each driver binds as its methods (`qmq.client.steps.bound`).
CLIENT_OPERATIONS = ("route", "send", "send_one", "cancel", "subscribe", "lock_queues")


class ClientCore:
    """A producer and the factory of subscriptions: its settings, its routes, the groups that failed
    lately, its subscriptions. A driver subclasses it, makes its connections in `_open` and binds the
    operations below as methods that run them; an operation's docstring is its method's promise."""

    def __init__(
        self,
        meta: str | None = None,
        brokers: Sequence[str] | None = None,
        token: str | None = None,
        client_id: str | None = None,
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        send_timeout_s: float = SEND_TIMEOUT_S,
        delivery_timeout_s: float = DELIVERY_TIMEOUT_S,
        delay_servers: Sequence[str] | None = None,
    ) -> None:
        """`meta` (default `$QMQ_META`, else 127.0.0.1:20880) or `brokers` (addresses, each a group of
        its own); `token` defaults to `$QMQ_TOKEN`; `delay_servers` instead of the meta server's.
        `send_timeout_s` bounds one request to a broker; `delivery_timeout_s` how long a send keeps
        offering a message that failed in a way worth trying again (a broker down, a failover, no
        writable group yet) before its result says it failed; 0: three attempts, within about 0.6 s."""
        if delivery_timeout_s < 0 or send_timeout_s <= 0:
            raise ValueError("delivery_timeout_s must be at least 0 and send_timeout_s above 0")
        self.meta, self.brokers = resolve_servers(meta, brokers)
        self.delay_servers = resolve_delay_servers(delay_servers)
        self.token = token
        self.client_id = client_id
        self.batch_size = batch_size
        self.send_timeout_s = send_timeout_s
        self.delivery_timeout_s = delivery_timeout_s
        self._routes = RouteBook(self.meta, self.brokers, self.delay_servers)
        self._health = GroupHealth()
        self._subscriptions: weakref.WeakSet[Any] = weakref.WeakSet()
        self._open()

    def _open(self) -> None:
        """The driver's connections, made once the settings are checked."""
        raise NotImplementedError

    def route(self, subject: str, *, refresh: bool = False) -> Steps[Route]:
        """The broker groups of `subject`, from the cache while it is fresh. Raises `MetaUnreachable`
        when the meta server cannot answer and no route was ever cached."""
        return self._routes.lookup(subject, refresh=refresh)

    def send(self, messages: Iterable[OutgoingMessage]) -> Steps[list[SendResult]]:
        """Send messages; one result per message, in order. Batches go out in parallel, one
        BROKER_SEND per group per `batch_size` messages; a message a broker would refuse is answered
        at once, without sending it (`check_message`); one that could not be stored is offered again
        for `delivery_timeout_s` before its result says so."""
        return sending.send(
            self._routes,
            self._health,
            messages,
            batch_size=self.batch_size,
            timeout_s=self.send_timeout_s,
            delivery_timeout_s=self.delivery_timeout_s,
        )

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
    ) -> Steps[SendResult]:
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
        [result] = yield from ClientCore.send(self, [message])  # this class's loop, not a driver's method
        if not result.ok:
            raise SendError(result)
        return result

    lock_queues = ordering.lock_queues  # the loop lives with the rest of ordered consumption

    def cancel(self, message_ids: Iterable[str]) -> Steps[dict[str, str]]:
        """Cancel delayed messages by id. Every delay server is asked (the message is on one of
        them); the outcome per id is "cancelled" (it will never be delivered), "too_late" (it was
        due already: delivered, or being delivered) or "unknown" (no delay server knows it;
        docs/delay.md). Raises `ClientError` when a delay server could not be asked."""
        return sending.cancel(self._routes, message_ids)

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
        ordered: bool = False,
        prefetch: bool = False,
        serve_ahead: bool = False,
    ) -> Steps[Any]:
        """Consume `subject` as consumer group `group` from every broker group of its route.

        `tags`: only messages with one of them (all of them with `match_all`). `broadcast`: this
        consumer gets every message, with its own position. `start`: where a group new to a broker
        begins, "latest" (messages stored from now on) or "earliest" (all still stored). The
        subscription registers with every broker before returning, so a message sent after
        `subscribe` returns reaches a new group. Raises `InvalidSubscription` (a ValueError) for
        what a broker would refuse, `MetaUnreachable`, or `NoRoute` when no broker group carries
        the subject. `ordered`: take only the queues set with `set_queues`, whose leases
        `lock_queues` got (docs/ordering.md; the worker does both). `prefetch`: each pull's reply
        is followed at once by the next pull, so the brokers prepare the next messages while the
        application handles these (for throughput; messages fetched ahead and not handed out when
        the subscription closes come again after the broker's consumer timeout). `serve_ahead`
        (implied by `prefetch`): messages stored between a pull's reply and the next pull, up to
        the room that pull left (`max` less what it got), are recorded for this consumer as they
        come, so the next pull finds them already journalled and answers without an fsync of its
        own (lower latency; the rest of the group does not get them meanwhile)."""
        options = SubscribeOptions(
            subject,
            group,
            consumer or default_consumer_id(),
            tuple(tags),
            match_all,
            broadcast,
            start,
            ordered,
            prefetch,
            serve_ahead,
        )
        subscription = yield Subscribe(options)
        self._subscriptions.add(subscription)
        return subscription
