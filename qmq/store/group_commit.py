"""Group commit on an event loop: the writes that arrive in one loop iteration share one store append
and one durability wait, so many small requests in flight cost one write per log and one fsync, not
one each. Used by the broker's and the delay server's sends.

Promises: a write's messages are appended together with the others of its iteration, in the order
the writes came; `write` returns their positions only once they are durable (per the store's flush
mode); `on_appended` runs right after each append with the messages appended, `on_durable` once
they are durable with where they went, group after group in message-log order, before the writes
return (an error it raises fails them). A store that cannot append or make durable fails every
write of the group with its error (`StoreError`, `FlushFailed`). The flush is asked for in the
append's own loop step, or, when `on_appended` returns true (it made steps ready that will append
too: the journal entries of the pulls it woke), in the next one, after them: one fsync covers all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Sequence

from qmq.store.store import Appended, LogStore, Message

log = logging.getLogger("qmq.store")

Written = list[tuple[Appended, Message]]  # where each message went, in log order


class _Group:
    """The writes of one loop iteration, appended together."""

    __slots__ = ("end", "futures", "start", "written")

    def __init__(
        self, start: int, end: int, written: list[Written], futures: list[asyncio.Future[list[Appended]]]
    ) -> None:
        self.start = start  # where its first message went
        self.end = end  # durable once the log is durable up to here
        self.written = written
        self.futures = futures


class GroupCommit:
    def __init__(
        self,
        store: LogStore,
        *,
        on_appended: Callable[[list[Message]], bool | None] | None = None,
        on_durable: Callable[[Written], None] | None = None,
    ) -> None:
        self.store = store
        self.on_appended = on_appended
        self.on_durable = on_durable
        self._waiting: list[tuple[Sequence[Message], asyncio.Future[list[Appended]]]] = []  # this iteration
        self._groups: deque[_Group] = deque()  # appended, not yet durable, in log order
        self._unsettled = 0  # appends whose durability is awaited
        self._drained: asyncio.Future[None] | None = None  # `close` waits on it

    def write(self, messages: Sequence[Message]) -> asyncio.Future[list[Appended]]:
        """Append `messages` with every other write of this loop iteration; the future resolves to
        their positions once they are durable."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[Appended]] = loop.create_future()
        if not self._waiting:
            loop.call_soon(self._append)
        self._waiting.append((messages, future))
        return future

    def settled_upto(self) -> int:
        """The message-log offset before which every write appended so far was settled (its
        `on_durable` ran, or it failed): a reader of the log up to here never races `on_durable`."""
        if self._groups:
            return self._groups[0].start
        return self.store.end_offset

    async def close(self) -> None:
        """Wait for the writes appended so far to settle (a request cut short still gets its
        messages through `on_durable`)."""
        while self._unsettled:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)  # a closer cancelled leaves the others waiting

    def _append(self) -> None:
        waiting, self._waiting = self._waiting, []
        messages = [m for batch, _ in waiting for m in batch]
        try:
            appended = self.store.append(messages)
        except Exception as exc:
            for _, future in waiting:
                _fail(future, exc)
            return
        written, i = [], 0
        for batch, _ in waiting:
            written.append(list(zip(appended[i : i + len(batch)], batch, strict=True)))
            i += len(batch)
        self._groups.append(_Group(appended[0].offset, appended[-1].end, written, [f for _, f in waiting]))
        more_to_come = False
        if self.on_appended is not None:
            try:
                more_to_come = self.on_appended(messages)
            except Exception:  # the writes are stored: they are settled all the same
                log.exception("on_appended failed after an append")
        # The writes are settled right from the loop's wake-up after the fsync, not from a task's step.
        self._unsettled += 1
        end = appended[-1].end
        if more_to_come:  # after the steps `on_appended` made ready: their entries share the fsync
            asyncio.get_running_loop().call_soon(self._when_durable, end)
        else:
            self._when_durable(end)

    def _when_durable(self, end: int) -> None:
        """Settle the groups up to `end` once durable; with the error if that cannot even be asked."""
        try:
            self.store.when_durable(end, lambda error: self._settle(end, error))
        except Exception as exc:
            self._settle(end, exc)

    def _settle(self, end: int, error: BaseException | None) -> None:
        """Everything up to `end` is durable (or `error`): settle every group before it, oldest first."""
        self._unsettled -= 1
        if not self._unsettled and self._drained is not None:
            if not self._drained.done():
                self._drained.set_result(None)
            self._drained = None
        while self._groups and self._groups[0].end <= end:
            group = self._groups.popleft()
            outcome = error
            if outcome is None and self.on_durable is not None:
                try:
                    self.on_durable([item for written in group.written for item in written])
                except Exception as exc:
                    outcome = exc
            for written, future in zip(group.written, group.futures, strict=True):
                if outcome is not None:
                    _fail(future, outcome)
                elif not future.done():
                    future.set_result([appended for appended, _ in written])


def _fail(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
        with contextlib.suppress(BaseException):
            future.exception()  # a request that gave up waiting must not log "never retrieved"
