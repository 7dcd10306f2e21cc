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

This module is a driver: the operations are the core's loops (`ClientCore`, `SubscriptionCore`),
and it only does their steps (`qmq.client.steps`) with threads and blocking waits.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from typing import Any, Concatenate, ParamSpec, TypeVar

from qmq.client.admin import ADMIN_OPERATIONS, AdminCore
from qmq.client.consuming import SubscriptionCore
from qmq.client.core import CLIENT_OPERATIONS, ClientCore
from qmq.client.deliveries import DEFAULT_PULL_MAX, DEFAULT_PULL_WAIT_S, Delivery, SubscribeOptions
from qmq.client.errors import ClientClosed, ClientError
from qmq.client.pool import ConnectionPool
from qmq.client.steps import Call, Calls, GetRoute, Sleep, Start, Step, Steps, Subscribe, WaitAll, WaitAny, bound

__all__ = ["Admin", "Client", "Subscription"]

SEND_THREADS = 16  # BROKER_SEND requests in flight at once for one send() call
MAX_PULL_THREADS = 16  # broker groups a subscription long-polls at once
ACK_THREADS = 16  # acknowledgements in flight beside the pulls (one per broker)

P = ParamSpec("P")
T = TypeVar("T")


def run(steps: Steps[T], do: Callable[[Step], Any]) -> T:
    """Run one of the core's loops to its end in this thread: `do` each step, send back its outcome."""
    outcome: Any = None
    try:
        while True:
            outcome = do(steps.send(outcome))
    except StopIteration as end:
        return end.value


def blocking(loop: Callable[Concatenate[Any, P], Steps[T]]) -> Callable[Concatenate[Any, P], T]:
    """The core's `loop` as a method of a blocking driver, which runs it with its `_do`."""

    @functools.wraps(loop)
    def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return run(loop(self, *args, **kwargs), self._do)

    return method


def request(pool: ConnectionPool, call: Call) -> Any:
    """The reply to `call`, or the exception that stood in its way (returned, not raised)."""
    try:
        return pool.request(call.address, call.code, call.body, call.timeout_s)
    except Exception as exc:
        return exc


def wait_one(future: Future[Any], timeout_s: float | None) -> None:
    """Return once `future` is done (with whatever outcome) or `timeout_s` passed: the one-future
    case of `wait(FIRST_COMPLETED)`, one lock and no waiter object between the reader thread that
    settles it and this one."""
    with contextlib.suppress(TimeoutError, CancelledError):
        future.exception(timeout_s)


@bound(ClientCore, CLIENT_OPERATIONS, blocking)
class Client(ClientCore):
    """A producer and the factory of subscriptions, over one pool of connections. Batches of one
    send go out in parallel, from a pool of threads."""

    def close(self) -> None:
        """Close every subscription (flushing its acks), every connection and the send threads."""
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

    def _open(self) -> None:
        self._pool = ConnectionPool(client_id=self.client_id, token=self.token)
        self._executor: ThreadPoolExecutor | None = None
        self._executor_lock = threading.Lock()

    def _do(self, step: Step) -> Any:
        if isinstance(step, Call):
            return request(self._pool, step)
        if isinstance(step, Calls):
            if len(step.calls) == 1:
                return [request(self._pool, step.calls[0])]
            try:
                futures = [self._send_executor().submit(request, self._pool, call) for call in step.calls]
            except RuntimeError:  # its threads were shut down by close()
                return [ClientClosed() for _ in step.calls]
            return [future.result() for future in futures]
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Subscribe):
            return Subscription(self, step.options)
        raise TypeError(f"a client does not do {step!r}")

    def _send_executor(self) -> ThreadPoolExecutor:
        with self._executor_lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=SEND_THREADS, thread_name_prefix="qmq-send")
            return self._executor


@bound(AdminCore, ADMIN_OPERATIONS, blocking)
class Admin(AdminCore, Client):
    """The administration calls (`qmq admin`, `qmq console`; `qmq.client.admin`) over a client's
    connections: `Admin(meta=...)` or `Admin(brokers=[...])`."""


class Subscription(SubscriptionCore):
    """Made by `Client.subscribe`. Pulls long-poll every broker group of the route at once: a pull
    returns as soon as any group has messages, and the groups still waiting stay in flight for the
    next call. It has its own connections, so that a broker closing one (after an ack it could not
    match) cuts only this subscription's requests.

    Deliveries pulled but never acknowledged go back to the group: at `close()`, which flushes the
    acknowledgements made so far and then gives back the rest, or, when the process stopped without
    closing, once the broker's consumer timeout passes."""

    client: Client
    nack = blocking(SubscriptionCore.nack)
    flush = blocking(SubscriptionCore.flush)
    heartbeat = blocking(SubscriptionCore.heartbeat)

    def __init__(self, client: Client, options: SubscribeOptions) -> None:
        super().__init__(client, options)
        try:
            run(self._register(), self._do)
        except BaseException:
            self._shutdown()
            raise

    def pull(self, max: int = DEFAULT_PULL_MAX, wait_s: float = DEFAULT_PULL_WAIT_S) -> list[Delivery]:
        """Up to `max` deliveries, waiting up to `wait_s` for the first; [] when none came. Raises
        `ClientError` only when a broker refuses the subscription itself (a bad argument)."""
        with self._pull_lock:
            return run(SubscriptionCore.pull(self, max, wait_s), self._do)

    def ack(self, delivery: Delivery) -> None:
        """Mark a delivery done. Acknowledgements go out in batches: on `flush()`, before a pull
        waits, and at least every ACK_FLUSH_INTERVAL_S while pull or ack is called."""
        if self._finish(delivery):
            self.flush()

    def close(self) -> None:
        """Flush acknowledgements, give back what is held unacknowledged (`SubscriptionCore.leave`)
        and close this subscription's connections. Idempotent."""
        if self.closed:
            return
        try:
            self.flush()
            run(SubscriptionCore.leave(self), self._do)
        finally:
            self._shutdown()

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> None:
        self._pull_lock = threading.Lock()  # one pull() at a time
        self._pool = ConnectionPool(client_id=self.client.client_id, token=self.client.token)
        self._executor = ThreadPoolExecutor(max_workers=MAX_PULL_THREADS + ACK_THREADS, thread_name_prefix="qmq-pull")
        self._wakeup = threading.Event()  # ends a Sleep when the subscription closes

    def _do(self, step: Step) -> Any:
        if isinstance(step, Start):
            return self._start(step.call)
        if isinstance(step, WaitAny):
            if len(step.handles) == 1:  # one broker group: wait on its future alone, without wait()'s waiter
                wait_one(step.handles[0], step.timeout_s)
            else:
                wait(step.handles, timeout=step.timeout_s, return_when=FIRST_COMPLETED)
            return None
        if isinstance(step, WaitAll):
            wait(step.handles, timeout=step.timeout_s)
            return None
        if isinstance(step, Call):
            return request(self._pool, step)
        if isinstance(step, Calls):  # acks and heartbeats: one after the other, off the pull threads
            return [request(self._pool, call) for call in step.calls]
        if isinstance(step, GetRoute):
            try:
                return self.client.route(step.subject)
            except ClientError as exc:
                return exc
        if isinstance(step, Sleep):
            self._wakeup.wait(step.seconds)
            return None
        raise TypeError(f"a subscription does not do {step!r}")

    def _start(self, call: Call) -> Future[Any]:
        """Put `call` in flight: on its open connection straight away (the reader thread answers the
        Future, one thread hop less), else from a pull thread that connects first."""
        conn = self._pool.connected(call.address)
        if conn is not None:
            try:
                return conn.start(call.code, call.body)
            except ConnectionError:
                pass  # lost meanwhile: the pull thread opens a new one
        return self._executor.submit(self._pool.request, call.address, call.code, call.body, call.timeout_s)

    def _shutdown(self) -> None:
        self._mark_closed()
        self._wakeup.set()
        self._pool.close()  # fails the pulls in flight at once
        self._executor.shutdown(wait=False, cancel_futures=True)
