"""The broker's background loops: due retries are appended to their retry subjects, the unacked
messages of consumers silent for the timeout go back to their group, and the consumption state is
snapshotted every few seconds, so a restart replays little of the journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from qmq.broker import snapshot
from qmq.broker.core import BrokerCore
from qmq.broker.give_back import give_back
from qmq.broker.journal import Fired
from qmq.broker.system_subjects import unwrap, user_subject, wrap
from qmq.protocol.ordering import split_queue_subject
from qmq.store.store import StoreError

log = logging.getLogger("qmq.broker")

SNAPSHOT_INTERVAL_S = 10.0
SNAPSHOTS_PER_RETENTION = 10  # a short log retention (tests) gets a snapshot this often per period, at least
RETRY_FIRE_BATCH = 1024  # due retries appended per round
RETRY_BACKOFF_S = 1.0  # after a round that could not append (store failure)
MAX_SWEEP_INTERVAL_S = 5.0  # silent consumers are looked for at least this often


def snapshot_interval_s(retention_s: float) -> float:
    """How often the consumption state is saved: every SNAPSHOT_INTERVAL_S, or more often under a
    log retention so short that the journal after a snapshot could expire before the next one."""
    return min(SNAPSHOT_INTERVAL_S, retention_s / SNAPSHOTS_PER_RETENTION)


class BackgroundWork:
    def __init__(self, core: BrokerCore, state_dir: Path) -> None:
        self.core = core
        self.state_dir = state_dir
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the loops on the running event loop."""
        for coro in (self._retry_loop(), self._sweep_loop(), self._snapshot_loop()):
            self._tasks.append(asyncio.create_task(coro))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    # ---- snapshots ------------------------------------------------------------------------------

    async def take_snapshot(self) -> None:
        """Save the state once the journal it covers is on disk (never ahead of it)."""
        data = self.core.state.to_snapshot()
        end = self.core.store.end_offset  # taken with the state: the journal it covers ends before
        await self.core.store.flushed(end)
        upto = self.core.replicated_upto()
        await asyncio.to_thread(snapshot.save, self.state_dir, data, log_end=end, replicated_upto=upto)

    async def _snapshot_loop(self) -> None:
        saved_at = self.core.state.journal_seq
        interval_s = snapshot_interval_s(self.core.store.config.retention_s)
        while True:
            await asyncio.sleep(interval_s)
            if self.core.state.journal_seq != saved_at:
                saved_at = self.core.state.journal_seq
                try:
                    await self.take_snapshot()
                except OSError as exc:  # disk full or I/O error: the store turns read-only, logs it once
                    self.core.store.write_failed(exc, "consumption snapshot")
                    saved_at = -1  # try again at the next interval
                except Exception:
                    log.exception("snapshot failed; the journal still has everything")

    # ---- retries --------------------------------------------------------------------------------

    async def _retry_loop(self) -> None:
        core = self.core
        while True:
            next_due = core.state.retries.next_due()
            timeout = None if next_due is None else max(0.0, next_due / 1000 - core.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await core.retries_changed.wait()
            core.retries_changed.clear()
            try:
                while self.fire_due():
                    await asyncio.sleep(0)
            except StoreError as exc:
                log.error("cannot append due retries, trying again in %g s: %s", RETRY_BACKOFF_S, exc)
                await asyncio.sleep(RETRY_BACKOFF_S)

    def fire_due(self) -> int:
        """Append due retries to their retry subjects; how many were due."""
        core = self.core
        due = core.state.retries.take_due(int(core.clock() * 1000), RETRY_FIRE_BATCH)
        if not due:
            return 0
        messages, woken = [], set()
        for entry in due:
            record = core.record_at(entry.offset)
            if record is None:
                log.warning(
                    "retry %d of %s: its message was removed by retention before it came due",
                    entry.id,
                    entry.retry_subject,
                )
                continue
            messages.append(wrap(record, entry.retry_subject, entry.attempt, entry.reason))
            woken.add(unwrap(record).subject)
        try:
            if messages:
                core.store.append(messages)
        except StoreError:
            core.state.retries.put_back(due)
            raise
        core.apply_and_commit([Fired(tuple(e.id for e in due))])
        core.wake(woken)
        return len(due)

    # ---- silent consumers -----------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        interval = min(MAX_SWEEP_INTERVAL_S, self.core.consumer_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except StoreError as exc:
                log.error("cannot release silent consumers' messages now: %s", exc)

    def sweep(self) -> int:
        """Give the unacked messages of consumers silent for the timeout back to their group, through
        the retry subject (due at once, one attempt more); how many were moved."""
        core = self.core
        moved = 0
        for group in list(core.state.groups.values()):
            if split_queue_subject(user_subject(group.subject)) is not None:
                continue  # an ordered queue: its lease moves it (qmq/broker/queue_lease.py), in order
            for release, seqs in group.silent(core.clock(), core.consumer_timeout_s):
                count, _ = give_back(core, group, release, seqs, [], "silent")
                log.warning(
                    "consumer %s of group %s on %s silent for %g s: %d unacked messages go back to the group",
                    release.consumer,
                    group.group,
                    group.subject,
                    core.consumer_timeout_s,
                    count,
                )
                moved += count
        return moved
