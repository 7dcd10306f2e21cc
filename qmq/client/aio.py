"""The asyncio client: the blocking client's API and promises, for code on an event loop (the delay
server sends with it).

    async with AsyncClient(meta="127.0.0.1:20880") as client:
        results = await client.send([OutgoingMessage("order.created", {"id": 7})])
        subscription = await client.subscribe("order.created", "billing")
        for delivery in await subscription.pull():
            await subscription.ack(delivery)

This module is a driver: the operations are the core's loops (`ClientCore`, `SubscriptionCore`), the
same as the blocking client's; it only does their steps (`qmq.client.steps`) with tasks and awaits.
Use one client from one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, TypeVar

from qmq.client.admin import ADMIN_OPERATIONS, AdminCore
from qmq.client.consuming import SubscriptionCore
from qmq.client.core import CLIENT_OPERATIONS, ClientCore
from qmq.client.deliveries import DEFAULT_PULL_MAX, DEFAULT_PULL_WAIT_S, Delivery
from qmq.client.errors import ClientError
from qmq.client.pool import AsyncConnectionPool
from qmq.client.steps import Call, Calls, GetRoute, Sleep, Start, Step, Steps, Subscribe, WaitAll, WaitAny, bound

__all__ = ["AsyncAdmin", "AsyncClient", "AsyncSubscription"]

MAX_SENDS_IN_FLIGHT = 16  # BROKER_SEND requests in flight at once for one client

P = ParamSpec("P")
T = TypeVar("T")


async def run(steps: Steps[T], do: Callable[[Step], Awaitable[Any]]) -> T:
    """Run one of the core's loops to its end on this event loop: `do` each step, send back its outcome."""
    outcome: Any = None
    try:
        while True:
            outcome = await do(steps.send(outcome))
    except StopIteration as end:
        return end.value


def awaiting(loop: Callable[Concatenate[Any, P], Steps[T]]) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    """The core's `loop` as a coroutine method of an asyncio driver, which runs it with its `_do`."""

    @functools.wraps(loop)
    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await run(loop(self, *args, **kwargs), self._do)

    return method


async def request(pool: AsyncConnectionPool, call: Call) -> Any:
    """The reply to `call`, or the exception that stood in its way (returned, not raised)."""
    try:
        return await pool.request(call.address, call.code, call.body, call.timeout_s)
    except Exception as exc:
        return exc


@bound(ClientCore, CLIENT_OPERATIONS, awaiting)
class AsyncClient(ClientCore):
    """A producer and the factory of subscriptions, over one pool of connections."""

    async def close(self) -> None:
        """Close every subscription (flushing its acks) and every connection."""
        for subscription in list(self._subscriptions):
            await subscription.close()
        await self._pool.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _open(self) -> None:
        self._pool = AsyncConnectionPool(client_id=self.client_id, token=self.token)
        self._sends = asyncio.Semaphore(MAX_SENDS_IN_FLIGHT)

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            return await request(self._pool, step)
        if isinstance(step, Calls):
            if len(step.calls) == 1:
                return [await self._send(step.calls[0])]
            return await asyncio.gather(*(self._send(call) for call in step.calls))
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Subscribe):
            subscription = AsyncSubscription(self, step.options)
            await subscription._start()
            return subscription
        raise TypeError(f"a client does not do {step!r}")

    async def _send(self, call: Call) -> Any:
        async with self._sends:
            return await request(self._pool, call)


@bound(AdminCore, ADMIN_OPERATIONS, awaiting)
class AsyncAdmin(AdminCore, AsyncClient):
    """The administration calls (`qmq.client.admin`) for code on an event loop."""


class AsyncSubscription(SubscriptionCore):
    """Made by `AsyncClient.subscribe`; see the blocking `Subscription` for what it promises."""

    client: AsyncClient
    nack = awaiting(SubscriptionCore.nack)
    flush = awaiting(SubscriptionCore.flush)
    heartbeat = awaiting(SubscriptionCore.heartbeat)

    async def _start(self) -> None:
        """Register with every broker of the route (see `SubscriptionCore._register`)."""
        try:
            await run(self._register(), self._do)
        except BaseException:
            await self._shutdown()
            raise

    async def pull(self, max: int = DEFAULT_PULL_MAX, wait_s: float = DEFAULT_PULL_WAIT_S) -> list[Delivery]:
        """Up to `max` deliveries, waiting up to `wait_s` for the first; [] when none came."""
        async with self._pull_lock:
            return await run(SubscriptionCore.pull(self, max, wait_s), self._do)

    async def ack(self, delivery: Delivery) -> None:
        """Mark a delivery done; acknowledgements go out in batches (see `Subscription.ack`)."""
        if self._finish(delivery):
            await self.flush()

    async def close(self) -> None:
        """Flush acknowledgements, give back what is held unacknowledged (`SubscriptionCore.leave`)
        and close this subscription's connections. Idempotent."""
        if self.closed:
            return
        try:
            await self.flush()
            await run(SubscriptionCore.leave(self), self._do)
        finally:
            await self._shutdown()

    async def __aenter__(self) -> AsyncSubscription:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _open(self) -> None:
        self._pull_lock = asyncio.Lock()  # one pull() at a time
        self._pool = AsyncConnectionPool(client_id=self.client.client_id, token=self.client.token)

    async def _do(self, step: Step) -> Any:
        if isinstance(step, Start):
            call = step.call
            conn = self._pool.connected(call.address)
            if conn is not None:  # written now, not when this loop next waits (the caller may not soon)
                with contextlib.suppress(ConnectionError):
                    return conn.start(call.code, call.body, call.timeout_s)
            return asyncio.get_running_loop().create_task(
                self._pool.request(call.address, call.code, call.body, call.timeout_s)
            )
        if isinstance(step, WaitAny):
            await asyncio.wait(step.handles, timeout=step.timeout_s, return_when=asyncio.FIRST_COMPLETED)
            return None
        if isinstance(step, WaitAll):
            await asyncio.wait(step.handles, timeout=step.timeout_s)
            return None
        if isinstance(step, Call):
            return await request(self._pool, step)
        if isinstance(step, Calls):
            return await asyncio.gather(*(request(self._pool, call) for call in step.calls))
        if isinstance(step, GetRoute):
            try:
                return await self.client.route(step.subject)
            except ClientError as exc:
                return exc
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        raise TypeError(f"a subscription does not do {step!r}")

    async def _shutdown(self) -> None:
        tasks = self._mark_closed()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._pool.close()
