"""What every part of the broker works on: the store, the consumption state, the journal through
which that state changes, and the pulls waiting for new messages (docs/broker.md).

Everything runs on the event loop thread. A change to the state is applied, then journalled in one
record of the `%ACTION%` subject (`commit`); whoever made it awaits the durability of the offset
`commit` returns before replying, so a change is never acknowledged before it would survive a crash.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable

from qmq.broker import journal
from qmq.broker.journal import Entry
from qmq.broker.state import BrokerState
from qmq.protocol.limits import ACTION_SUBJECT, DEFAULT_LIMITS, Limits
from qmq.protocol.ordering import base_subject
from qmq.store import record as rec
from qmq.store.store import LogStore, Message

DEFAULT_CONSUMER_TIMEOUT_S = 60.0  # a consumer silent this long loses its unacked messages to its group
DEFAULT_MAX_ATTEMPTS = 32  # then a message goes to the dead-letter subject

Clock = Callable[[], float]


async def _nothing_to_wait_for(end: int) -> None:
    """A broker alone: durable on its own disk is enough."""


class BrokerCore:
    def __init__(
        self,
        store: LogStore,
        state: BrokerState,
        *,
        consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        limits: Limits = DEFAULT_LIMITS,
        clock: Clock = time.time,
    ) -> None:
        self.store, self.state, self.clock = store, state, clock
        self.consumer_timeout_s = consumer_timeout_s
        self.max_attempts = max_attempts
        self.limits = limits
        self.group_name = ""  # known once the process listens (broker-<port> by default)
        self.read_only = False  # set by the meta server (or too few replicas in sync): sends go elsewhere
        # A replicated group's master waits here until enough replicas hold a send (qmq/replication/roles.py).
        self.replicated: Callable[[int], Awaitable[None]] = _nothing_to_wait_for
        # ...and below this offset every replica holds the log: snapshots keep one at or below it.
        self.replicated_upto: Callable[[], int | None] = lambda: None
        # ...and whether it may act for its group now: master, not fenced, not handing off (Roles.in_office).
        self.in_office: Callable[[], bool] = lambda: True
        self.retries_changed = asyncio.Event()  # a retry was scheduled: the retry loop looks again
        # subject -> waiting pulls, in the order they came (a dict as an ordered set): the first woken
        # takes first, so one consumer cannot starve another of a group by pulling more often
        self._waiters: dict[str, dict[asyncio.Future[None], None]] = defaultdict(dict)
        # told the base subjects of what was stored, once their waiting pulls are woken (ahead.py);
        # true when it made a step ready that will journal
        self.stored_listeners: list[Callable[[set[str]], bool]] = []

    # ---- the journal ----------------------------------------------------------------------------

    def commit(self, entries: list[Entry], *, delivery: bool = False) -> int:
        """Journal `entries`, already applied; the log offset whose durability covers them.

        `delivery`: the entries only record pulls and acks. While the store is out of space they are
        kept in memory alone (the next snapshot saves them once space is back), so consumers keep
        reading from a full disk; a crash meanwhile redelivers what they record, which at-least-once
        delivery allows. Any other change fails while the store is read-only."""
        if delivery and self.store.out_of_space:
            return 0
        appended = self.store.append([Message(ACTION_SUBJECT, f"%a{self.state.journal_seq}", journal.encode(entries))])
        self.state.journal_seq = appended[0].seq + 1
        return appended[0].end

    def apply_and_commit(self, entries: list[Entry]) -> int:
        now = self.clock()
        for entry in entries:
            self.state.apply(entry, now)
        return self.commit(entries)

    # ---- pulls waiting for messages ---------------------------------------------------------------

    async def wait_for_messages(self, subject: str, timeout_s: float) -> bool:
        """Wait until a message of `subject` (or of its retry subjects) is stored; False after
        `timeout_s` without one."""
        future = asyncio.get_running_loop().create_future()
        self._waiters[subject][future] = None
        try:
            async with asyncio.timeout(timeout_s):
                await future
            return True
        except TimeoutError:
            return False
        finally:
            waiting = self._waiters.get(subject)
            if waiting is not None:
                waiting.pop(future, None)
                if not waiting:  # a broker of many short-lived subjects keeps no empty entry per subject
                    del self._waiters[subject]

    def waiting_pulls(self) -> dict[str, int]:
        """Pulls waiting for messages, per subject (ordered queues count under their base subject)."""
        return {subject: len(waiting) for subject, waiting in self._waiters.items() if waiting}

    def wake(self, subjects: Iterable[str]) -> bool:
        """Messages of `subjects` were stored: wake the pulls waiting for them. True when that made
        steps ready that will journal (a woken pull's take, a listener's), for the group commit to
        ask for the flush after them."""
        bases = {base_subject(stored) for stored in subjects}  # a queue's messages wake its subject's ordered pulls
        woke = False
        for subject in bases:
            for future in self._waiters.pop(subject, ()):
                if not future.done():
                    future.set_result(None)
                    woke = True
        for listener in self.stored_listeners:
            woke = listener(bases) or woke
        return woke

    # ---- reading --------------------------------------------------------------------------------

    def record_at(self, offset: int) -> rec.Record | None:
        """The record at message-log `offset`, or None if retention removed it."""
        if offset < self.store.start_offset:
            return None
        return self.store.read_record(offset)
