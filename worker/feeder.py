"""One consumer's pull loop: subscribe (again and again until the brokers or the meta server answer),
then pull as much as the worker's capacity allows and hand each delivery to the pool.

A lost broker is the client's business: a `Subscription` long-polls every broker group of the route,
reconnects, and leaves what a lost broker handed out to be delivered again. What the feeder adds is
that it never gives up: a subscription that cannot be made is retried with backoff, and a pull that
fails is logged and retried, so a worker comes back by itself when its servers do.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from qmq.client import Client, ClientError, Delivery, Subscription
from worker.app import Consumer
from worker.capacity import Capacity

log = logging.getLogger("qmq.worker")

PULL_WAIT_S = 1.0  # long-poll time of one pull: also the longest a warm shutdown waits for a pull
RESERVE_WAIT_S = 1.0  # how long the feeder waits for credit before looking at the stop flag again
SUBSCRIBE_RETRY_S = 0.5  # after a failed subscribe, then doubling...
SUBSCRIBE_RETRY_MAX_S = 10.0  # ...up to this
LEFTOVER_BATCH = 256


class Feeder:
    ordered = False  # an OrderedFeeder (ordered_feeder.py) consumes queue by queue

    def __init__(
        self,
        consumer: Consumer,
        client: Client,
        consumer_id: str,
        capacity: Capacity,
        dispatch: Callable[[Feeder, list[Delivery]], None],
        default_start: str = "earliest",
    ) -> None:
        self.consumer = consumer
        self.client = client
        self.consumer_id = consumer_id
        self.capacity = capacity
        self.dispatch = dispatch
        self.start_at = consumer.start or default_start  # where the group begins on a broker new to it
        self.subscription: Subscription | None = None
        self.subscribed = threading.Event()
        self.problem: str | None = None  # why it is not consuming, while it is not
        self.problem_since: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"qmq-feed-{consumer.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop pulling; a pull in flight is finished and its messages dispatched."""
        self._stop.set()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        delay = SUBSCRIBE_RETRY_S
        while not self._stop.is_set() and self.subscription is None:
            if self._subscribe():
                break
            self._stop.wait(delay)
            delay = min(SUBSCRIBE_RETRY_MAX_S, delay * 2)
        while not self._stop.is_set():
            if not self._may_pull():
                continue
            take = self.capacity.reserve(RESERVE_WAIT_S)
            if take == 0:
                continue
            deliveries: list[Delivery] = []
            try:
                deliveries = self._pull(take)
            finally:
                self.capacity.received(take, len(deliveries))
            if deliveries:
                self._deliver(deliveries)
                # Let the pool thread just woken take the GIL now, rather than after this thread has
                # built and sent its next pull: the handler is the message's latency, the next pull
                # can wait that long (docs/benchmarks.md, a seventeenth machine).
                time.sleep(0)
        self._hand_over_buffered()

    def _may_pull(self) -> bool:
        """Whether to pull now (an ordered feeder holding no queue waits instead)."""
        return True

    def _deliver(self, deliveries: list[Delivery]) -> None:
        self.dispatch(self, deliveries)

    def _hand_over_buffered(self) -> None:
        """On stopping: what the client received beyond the last pull (its registration pull, or a
        second broker group answering too) is this worker's to finish, or it would wait for the
        broker's consumer timeout."""
        if self.subscription is None:
            return
        while deliveries := self.subscription.take_buffered(LEFTOVER_BATCH):
            self.capacity.received(0, len(deliveries))
            self._deliver(deliveries)

    def _subscribe(self) -> bool:
        c = self.consumer
        try:
            self.subscription = self.client.subscribe(
                c.subject, c.group, consumer=self.consumer_id, start=self.start_at, **self._subscription_options()
            )
        except ClientError as exc:
            self._trouble(f"cannot subscribe to {c.subject} as {c.group}: {exc}")
            return False
        self._fine()
        self.subscribed.set()
        how = " in order" if self.ordered else ""
        log.info("consuming %s%s as group %s (consumer %s)", c.subject, how, c.group, self.consumer_id)
        return True

    def _subscription_options(self) -> dict[str, Any]:
        c = self.consumer
        # serve_ahead: what comes while this feeder dispatches is journalled for its next pull, up to
        # the credit its last pull left unused (capacity.py), so that pull answers without an fsync
        return {"tags": c.tags, "match_all": c.match_all, "broadcast": c.broadcast, "serve_ahead": True}

    def _pull(self, take: int) -> list[Delivery]:
        assert self.subscription is not None
        try:
            deliveries = self.subscription.pull(max=take, wait_s=PULL_WAIT_S)
        except ClientError as exc:  # the brokers refuse this subscription: say so, keep trying
            self._trouble(str(exc))
            self._stop.wait(SUBSCRIBE_RETRY_MAX_S)
            return []
        except Exception as exc:  # a bug must not silently end consumption: log it, go on
            log.exception("pulling %s failed", self.consumer.name)
            self._trouble(f"pulling failed: {exc!r}")
            self._stop.wait(SUBSCRIBE_RETRY_S)
            return []
        self._fine()
        return deliveries

    def _trouble(self, problem: str) -> None:
        if self.problem != problem:
            log.error("%s; retrying", problem)
        if self.problem_since is None:
            self.problem_since = time.monotonic()
        self.problem = problem

    def _fine(self) -> None:
        if self.problem is not None:
            log.info("%s: consuming again", self.consumer.name)
        self.problem = self.problem_since = None
