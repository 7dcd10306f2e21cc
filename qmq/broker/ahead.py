"""Serving ahead: messages stored while a consumer that asked for it (a prefetching client, the
worker) is between two pulls are handed to it in advance, journalled right behind the send that
stored them, so that its next pull finds them durable and answers at once instead of waiting for a
journal fsync of its own.

Without it, a message that comes while the consumer's next pull is still on its way pays two fsyncs
in series before it reaches the consumer: its send's, then that pull's journal entry's
(docs/benchmarks.md). A pull with `ahead: N` (the client's `prefetch=True`) asks for it. From the
moment that pull has its messages (its reply then waits for their journal entry), or is answered
empty, until the consumer's next pull arrives, for at most AHEAD_WINDOW_S (`qmq broker
--serve-ahead`), up to N messages of its subject stored meanwhile and not taken by a pull already
waiting, and no more than the pull's `max` less what it took (the room the consumer said it had),
are recorded in its pull log (the `Pull` entry a pull journals); the next pull hands them out
as it hands out anything recorded for the consumer and not yet received.

Promises, the same as for a pull: a message is handed to one consumer of a group at a time; nothing
reaches a consumer before its journal entry is durable (`reserved_end`); a consumer that closes gives
what it was served ahead back at once, keeping its attempt (BROKER_LEAVE: it never saw them), and one
that goes silent loses it to its group after the consumer timeout, as anything it held.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from qmq.broker import metrics
from qmq.broker.core import BrokerCore

if TYPE_CHECKING:
    from qmq.broker.consuming import PullRequest

log = logging.getLogger("qmq.broker")

AHEAD_WINDOW_S = 1.0  # once a pull has its messages (or its empty reply), how long its consumer counts as coming back

Take = Callable[["PullRequest", int], "tuple[list[dict], int | None]"]  # Consuming._take_ahead


class ServeAhead:
    """The consumers between two pulls that asked to be served ahead, and the reservations for them."""

    def __init__(self, core: BrokerCore, take: Take, window_s: float = AHEAD_WINDOW_S) -> None:
        """`window_s`: how long after its pull (`answering`) a consumer counts as coming back (0: never)."""
        self.core = core
        self._take = take
        self.window_s = window_s
        # (subject, group key, consumer) -> its last pull, the loop time it stops counting as away, and
        # how many messages may be served to it ahead
        self.away: dict[tuple[str, str, str], tuple[PullRequest, float, int]] = {}
        # the log end after the last reservation's journal entry (or a take's that failed part-way):
        # a pull that hands out what was reserved waits for it to be durable
        self.reserved_end = 0
        core.stored_listeners.append(self.stored)

    def answering(self, pull: PullRequest, taken: int) -> None:
        """`pull` has taken `taken` messages to hand out (its reply waits for the journal) or is
        answered empty: if it asked to be served ahead and had room for more, its consumer is away
        until its next pull. Messages stored while the reply still waits for its fsync are served
        ahead too: they share the next fsync with their send, where the next pull would have paid
        one more. A consumer that took all it asked for has no room: a worker's pull asks for what
        its free slots can start soon (worker/capacity.py), and serving it more would hold messages
        back from the rest of its group."""
        room = min(pull.ahead, pull.max_count - taken)
        if room > 0 and self.window_s > 0:
            until = asyncio.get_running_loop().time() + self.window_s
            self.away[(pull.subject, pull.key, pull.consumer)] = (pull, until, room)

    def back(self, pull: PullRequest) -> None:
        """`pull` arrived: its consumer is no longer away."""
        if self.away:
            self.away.pop((pull.subject, pull.key, pull.consumer), None)

    def left(self, consumers: Iterable[str]) -> None:
        """These consumers closed: serve them nothing more."""
        gone = set(consumers)
        for key in [k for k in self.away if k[2] in gone]:
            del self.away[key]

    def journalled(self, end: int) -> None:
        """Messages a later pull may hand out were recorded in the journal up to `end`: that pull waits
        for it to be durable, which starts now, while the consumer's pull is on its way."""
        self.reserved_end = max(self.reserved_end, end)
        self.core.store.flusher.request(end)

    def stored(self, subjects: set[str]) -> bool:
        """Messages of `subjects` (base subjects) were stored and the pulls waiting for them woken:
        once those pulls have taken theirs (they run first, being woken first), reserve the rest.
        True when a reservation is to come (it journals)."""
        if any(pull.subject in subjects for pull, _, _ in self.away.values()):
            asyncio.get_running_loop().call_soon(self._reserve, subjects)
            return True
        return False

    def _reserve(self, subjects: set[str]) -> None:
        now = asyncio.get_running_loop().time()
        for key, (pull, until, room) in list(self.away.items()):
            if until < now:
                del self.away[key]
                continue
            if pull.subject not in subjects:
                continue
            try:
                batches, end = self._take(pull, room)
            except Exception as exc:  # the store is read-only, a record unreadable: the next pull sees
                log.debug("cannot serve %s of group %s ahead: %s", pull.consumer, pull.key, exc)
                del self.away[key]
                continue
            if end is not None:
                self.journalled(end)
            served = sum(len(b["messages"]) for b in batches)
            if served:
                metrics.SERVED_AHEAD.inc(served)
                if served < room:
                    self.away[key] = (pull, until, room - served)
                else:
                    del self.away[key]  # no room left: the next pull takes them, and asks again
