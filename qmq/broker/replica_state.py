"""A broker replica's consumption state, derived from the journal it copies (docs/replication.md,
"Consumption state on broker replicas").

A replica copies the master's message log, `%ACTION%` journal included, but retention runs on it
too: recovering the state from the journal alone at promotion would lose what retention removed
(the positions of groups idle for longer than the retention, their retries and dead-letter marks).
So a replica keeps the state as the master does: recovered at open from its own snapshot and
journal, brought forward after each durable chunk (`replicated`), and saved to its own
`consumers/` as often as a master does (background.py; the last few are kept, snapshot.py, so a cut
log can go back to one that covers nothing cut, as a master's, and one at or below what the master
says every replica holds is set aside, for a replica cut off with its master for long). The state
only ever covers journal records that are durable here, so a saved snapshot never runs ahead of the
log it covers. At promotion the master's recovery starts from the last snapshot (`close` saves one).

The work (reading journal records, applying them, saving) runs off the event loop, one step at a
time in one task, so the fetcher never waits for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path

from qmq.broker import recovery, snapshot
from qmq.broker.background import snapshot_interval_s
from qmq.broker.state import BrokerState
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.store.store import LogStore

log = logging.getLogger("qmq.broker")

APPLY_RETRY_S = 1.0  # after a step that failed (an unreadable journal record, a full disk)


class ReplicaState:
    def __init__(
        self, store: LogStore, state_dir: Path, *, replicated_upto: Callable[[], int | None] = lambda: None
    ) -> None:
        """`replicated_upto()`: what the master says every replica holds (snapshot.py keeps a
        snapshot at or below it, as the master does)."""
        self.store = store
        self.state_dir = state_dir
        self.replicated_upto = replicated_upto
        self.snapshot_interval_s = snapshot_interval_s(store.config.retention_s)  # as a master's
        self.state: BrokerState | None = None
        self.durable = 0  # the log is durable up to here: the state may cover it
        self._saved_seq = -1  # journal sequence of the last snapshot saved
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def open(self) -> None:
        """Recover the state (snapshot, then the durable journal after it) and start following."""
        self.durable = self.store.durable_offset
        self.state = await asyncio.to_thread(self._recover)
        self._saved_seq = self.state.journal_seq
        self._task = asyncio.create_task(self._follow(), name="qmq-broker-replica-state")

    def _recover(self) -> BrokerState:
        # A copied snapshot may cover journal records still to be fetched (state_copy.py): kept.
        state = recovery.load(self.store, self.state_dir, time.time(), ahead_ok=True)
        replayed = recovery.replay(self.store, state, time.time(), upto=self.durable)
        log.info(
            "replica consumption state: %d groups, %d pending retries, %d journal entries replayed, journal "
            "sequence %d",
            len(state.groups),
            len(state.retries),
            replayed,
            state.journal_seq,
        )
        return state

    def replicated(self, end: int) -> None:
        """The log is durable up to `end`: apply the journal records it brought (soon, not now)."""
        self.durable = max(self.durable, end)
        self._wake.set()

    async def close(self) -> None:
        """Stop following, then save what is applied (all of it durable) for the next start or the
        master's recovery at promotion."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self.state is not None:
            try:
                await asyncio.to_thread(self._step, True)
            except Exception:
                log.exception("cannot save the replica's consumption snapshot; the journal still has everything")

    async def _follow(self) -> None:
        saved_at = time.monotonic()
        while True:
            timeout = max(0.0, saved_at + self.snapshot_interval_s - time.monotonic())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
            self._wake.clear()
            save = time.monotonic() - saved_at >= self.snapshot_interval_s
            if not save and not self._journal_grew():
                continue  # a chunk of sends only: no thread hop for nothing to apply
            try:
                await asyncio.to_thread(self._step, save)
            except Exception:
                log.exception("replica consumption state: cannot follow the journal; trying again")
                await asyncio.sleep(APPLY_RETRY_S)
                continue
            if save:
                saved_at = time.monotonic()

    def _journal_grew(self) -> bool:
        """Whether journal records came that are not applied yet. Read without the store's lock: one
        whose chunk is still being written is applied at the next chunk, snapshot or close."""
        state = self.state
        return state is None or self.store.peek_next_seq(ACTION_SUBJECT) > state.journal_seq

    def _step(self, save: bool) -> None:
        """Apply the durable journal records not applied yet; save a snapshot if asked and the state
        moved since the last one. Blocking; one at a time (the task's, or close's once it stopped)."""
        state = self.state
        assert state is not None
        upto = self.durable
        recovery.replay(self.store, state, time.time(), upto=upto)
        if save and state.journal_seq != self._saved_seq:
            snapshot.save(self.state_dir, state.to_snapshot(), log_end=upto, replicated_upto=self.replicated_upto())
            self._saved_seq = state.journal_seq
