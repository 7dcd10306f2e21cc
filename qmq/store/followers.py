"""The master's side of store replication, shared by the broker and the delay server
(docs/replication.md): it answers replicas' REPL_FETCH and REPL_EPOCH_END, tracks how far each
replica has its log durable, says which replicas are in sync, and holds back an acknowledgement
until enough replicas have what it covers.

- A fetch's `durable` (its `offset` when absent: older replicas) is the replica's durable end:
  everything before it is on the replica's disk (QMQ's idea: the next request is the
  acknowledgement of the last reply). `offset` is where to read from: a replica that learnt from a
  reply's `pipelined` that this master reads `durable` asks for the next chunk while its fsync of
  the last one runs, and says when the fsync is done with a fetch of `max_bytes` 0 (answered at
  once, without data; sent one-way).
- A replica is **in sync** while its durable offset is within `max_lag_bytes` of the log end and it
  caught up with the log end within `max_lag_s`: it reached the end as it is now, or the end as of
  an earlier reply, which it did at that reply's time (as Kafka counts it).
- `acknowledged(end)` returns once `ack_replicas` replicas reported an offset at or past `end`,
  counting only the replicas `counted()` names (the meta server promotes only replicas it heard
  were in sync, so an acknowledgement from another could be lost in a failover); it raises
  `NotEnoughReplicas` when fewer than that are in sync, or when this master is fenced.
- A fetch waits for new records at most half of `max_lag_s`: an idle replica fetches again well
  before it would age out of sync, even with a `--max-lag` shorter than the wait it asks for.
- A fetch naming a newer epoch than this master's tells it it was deposed (`on_newer_epoch`).

Runs on the event loop; no sockets (the server's handler table calls `fetch` and `epoch_end`).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from typing import Any

from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.fields import bad, field
from qmq.store import epochs as ep
from qmq.store.store import LogStore

MAX_LAG_S = 5.0  # a replica that has not caught up for this long is out of sync
MAX_LAG_BYTES = 64 * 1024 * 1024  # nor one this far behind
MAX_FETCH_BYTES = 12 * 1024 * 1024  # one REPL_FETCH reply carries at most this (frames are 16 MiB)
MAX_FETCH_WAIT_MS = 30_000
RETENTION_REFUSED = "removed by retention"  # in the refusal of a fetch from before the log's start
MAX_REPLIES_KEPT = 64  # per replica: the ends of replies it has not yet caught up with


class NotEnoughReplicas(Exception):
    """Fewer replicas are in sync than the acknowledgement rule needs (or the master is fenced)."""


@dataclass
class ReplicaState:
    address: str
    offset: int = 0  # durable on the replica before this
    caught_up_at: float = 0.0  # monotonic time it last reached the log end
    fetched_at: float = 0.0
    # (log end, monotonic time) of the replies it has not yet caught up with, oldest first
    replies: deque[tuple[int, float]] = dataclass_field(default_factory=deque)

    def lag_bytes(self, end: int) -> int:
        return max(0, end - self.offset)

    def lag_s(self, end: int, now: float) -> float:
        return 0.0 if self.offset >= end else max(0.0, now - self.caught_up_at)

    def durable_at(self, durable: int, end: int, now: float) -> None:
        """The replica has everything before `durable` on disk (the log ends at `end` now)."""
        self.offset = durable
        if durable >= end:
            self.caught_up_at = now
            self.replies.clear()
            return
        replies = self.replies
        while replies and replies[0][0] <= durable:  # it holds what this master had at that reply
            self.caught_up_at = max(self.caught_up_at, replies.popleft()[1])

    def replied(self, end: int, now: float) -> None:
        """A reply told it the log ends at `end`. (One that holds it all already stays caught up as of
        its fetch, not of this reply: a replica killed during its long poll must still fall out of
        sync within max_lag_s of its last fetch.)"""
        replies = self.replies
        if replies and replies[-1][0] >= end:
            return  # an earlier reply told it as much: its time is what counts
        replies.append((end, now))
        if len(replies) > MAX_REPLIES_KEPT:
            replies.popleft()


class Followers:
    def __init__(
        self,
        store: LogStore,
        *,
        epoch: int,
        epochs: ep.Epochs,
        ack_replicas: int | None,
        max_lag_s: float = MAX_LAG_S,
        max_lag_bytes: int = MAX_LAG_BYTES,
        on_newer_epoch: Callable[[int], None] = lambda epoch: None,
        fenced: Callable[[], bool] = lambda: False,
        known_replicas: Callable[[], int] = lambda: 0,
        counted: Callable[[], Collection[str]] | None = None,
    ) -> None:
        """`ack_replicas` None: 1 when the group has a replica (`known_replicas()`, or one that
        fetched), else 0. `counted`: the replicas whose durable offsets acknowledge (None: every
        replica); call `settle()` when it changes."""
        self.store = store
        self.epoch = epoch
        self.epochs = epochs
        self.ack_replicas_setting = ack_replicas
        self.max_lag_s = max_lag_s
        self.max_lag_bytes = max_lag_bytes
        self.on_newer_epoch = on_newer_epoch
        self.fenced = fenced
        self.known_replicas = known_replicas
        self.counted = counted
        self.replicas: dict[str, ReplicaState] = {}
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []  # a heap by end
        self._count = itertools.count()
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._appended = asyncio.Event()
        self._closed = False
        store.append_listeners.append(self._on_append)

    # ---- the acknowledgement rule ---------------------------------------------------------------

    @property
    def ack_replicas(self) -> int:
        if self.ack_replicas_setting is not None:
            return self.ack_replicas_setting
        return 1 if self.replicas or self.known_replicas() > 0 else 0

    def in_sync(self, now: float | None = None) -> list[str]:
        now = time.monotonic() if now is None else now
        end = self.store.end_offset
        return [
            r.address
            for r in self.replicas.values()
            if r.lag_bytes(end) <= self.max_lag_bytes and now - r.caught_up_at <= self.max_lag_s
        ]

    @property
    def writable(self) -> bool:
        """Whether sends may be taken: enough replicas in sync, and not fenced."""
        needed = self.ack_replicas
        if needed == 0:
            return True
        return not self.fenced() and len(self.in_sync()) >= needed

    async def acknowledged(self, end: int) -> None:
        """Return once `ack_replicas` replicas have everything before `end` durable."""
        needed = self.ack_replicas
        if needed == 0:
            return
        if self._closed:  # `close` failed the waiters it found; none may wait after it
            raise RemoteError(ErrorCode.NOT_MASTER, "this server is no longer master")
        if not self.writable:
            raise NotEnoughReplicas(self.why_not_writable())
        if self._acked_offset(needed) >= end:
            return
        future = self._loop.create_future()
        heapq.heappush(self._waiters, (end, next(self._count), future))
        await future

    def check(self) -> None:
        """Fail the waiting acknowledgements when the rule can no longer be met (called often)."""
        if self._waiters and not self.writable:
            self._fail_all(NotEnoughReplicas(self.why_not_writable()))

    def why_not_writable(self) -> str:
        """Why sends are refused now (for the client's error and the server's log)."""
        if self.fenced():
            return "this master lost the meta server and fenced itself"
        return f"{len(self.in_sync())} replica(s) in sync, {self.ack_replicas} needed"

    def replicated_upto(self) -> int | None:
        """The offset before which every replica this master heard from holds its log durable (None
        before any did): a failover's new master is one of them, so no cut goes below it. A replica
        out of reach keeps its last report, which is what counts during a split."""
        return min((r.offset for r in self.replicas.values()), default=None)

    def _acked_offset(self, needed: int) -> int:
        counted = None if self.counted is None else self.counted()
        replicas = self.replicas.values()
        offsets = sorted((r.offset for r in replicas if counted is None or r.address in counted), reverse=True)
        return offsets[needed - 1] if len(offsets) >= needed else -1

    def settle(self) -> None:
        """Wake the acknowledgements that `counted()` now covers."""
        self._settle()

    def _settle(self) -> None:
        needed = self.ack_replicas
        acked = self._acked_offset(needed) if needed else 1 << 62
        while self._waiters and self._waiters[0][0] <= acked:
            future = heapq.heappop(self._waiters)[2]
            if not future.done():
                future.set_result(None)

    def _fail_all(self, error: BaseException) -> None:
        waiters, self._waiters = self._waiters, []
        for _, _, future in waiters:
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a request that gave up must not log "never retrieved"

    def close(self, error: BaseException) -> None:
        """This server is master no more: every waiting acknowledgement fails with `error`."""
        self._closed = True
        self._fail_all(error)
        self._appended.set()
        if self._on_append in self.store.append_listeners:
            self.store.append_listeners.remove(self._on_append)

    def drop_forgotten(self, members: set[str], now: float | None = None) -> list[str]:
        """Drop the replicas that are not among the group's `members` (the meta server forgot them:
        `qmq admin group forget`) and have not fetched within `max_lag_s`: they no longer count for
        the default acknowledgement rule nor show in the stats. One that still fetches is kept (it
        registers again at its next heartbeat). Returns the addresses dropped."""
        now = time.monotonic() if now is None else now
        gone = [a for a, r in self.replicas.items() if a not in members and now - r.fetched_at > self.max_lag_s]
        for address in gone:
            del self.replicas[address]
        if gone:
            self._settle()
        return gone

    # ---- requests ---------------------------------------------------------------------------------

    async def fetch(self, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_FETCH: note the replica's durable offset, then send what follows `offset` (long poll).
        `max_bytes` 0: a report of the durable offset only, answered at once without data."""
        replica = field(body, "replica", str)
        epoch = field(body, "epoch", int)
        offset = field(body, "offset", int)
        durable = field(body, "durable", int, offset)
        max_bytes = min(field(body, "max_bytes", int), MAX_FETCH_BYTES)
        wait_ms = min(field(body, "wait_ms", int, 0), MAX_FETCH_WAIT_MS, max(1, int(self.max_lag_s * 1000 / 2)))
        if offset < 0 or max_bytes < 0 or wait_ms < 0:
            raise bad("offset, max_bytes and wait_ms must not be negative")
        if not 0 <= durable <= offset:
            raise bad(f"durable offset {durable} must lie between 0 and the fetch offset {offset}")
        self._check_epoch(epoch)
        damaged_at = field(body, "damaged_at", int, None)
        if damaged_at is not None:  # our record there failed the replica's CRC check
            self.store.note_damage(damaged_at, f"found by replica {replica}")
        end = self.store.end_offset
        if offset > end:
            raise RemoteError(
                ErrorCode.BAD_REQUEST,
                f"offset {offset} is past this master's log end {end} (epoch {self.epoch}): "
                "truncate to REPL_EPOCH_END of your last epoch",
            )
        if offset < self.store.start_offset:
            raise RemoteError(
                ErrorCode.BAD_REQUEST,
                f"offset {offset} was {RETENTION_REFUSED} (log starts at {self.store.start_offset})",
            )
        now = time.monotonic()
        state = self.replicas.get(replica)
        if state is None:  # caught up only once it reaches the end as it is now
            state = self.replicas[replica] = ReplicaState(replica, durable)
            state.replied(end, now)
        state.fetched_at = now
        state.durable_at(durable, end, now)
        self._settle()  # every acknowledgement this report covers, woken at once
        if max_bytes == 0:
            return {"epoch": self.epoch, "data": b"", "end": end, "epochs": [], "pipelined": True}
        if offset >= self._shippable() and wait_ms > 0:
            self._appended.clear()
            try:
                async with asyncio.timeout(wait_ms / 1000):
                    while offset >= self._shippable() and not self._closed:
                        self._appended.clear()
                        await self._wait_appended()
            except TimeoutError:
                pass
        self._check_epoch(epoch)
        # Shipped before this master's own fsync, so both disks sync at once (as Kafka does). A
        # replica may then hold records this master loses in a crash; they were never acknowledged
        # (that needs this master durable too), and the replica cuts them when it fetches again
        # (its offset past the master's end: REPL_EPOCH_END), or keeps them if promoted.
        limit = self.store.end_offset
        data = self.store.read_chunk(offset, max_bytes, limit)
        state.replied(limit, time.monotonic())
        reply = {
            "epoch": self.epoch,
            "data": data,
            "end": limit,
            "epochs": [list(e) for e in self.epochs],
            "pipelined": True,  # this master takes `durable` as the acknowledgement, not `offset`
        }
        if (upto := self.replicated_upto()) is not None:
            reply["replicated"] = upto  # no failover cuts below it (the replica's snapshots, snapshot.py)
        return reply

    async def epoch_end(self, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_EPOCH_END: where `epoch` ends in this master's log."""
        epoch = field(body, "epoch", int)
        return {"epoch": self.epoch, "end_offset": ep.end_of(self.epochs, epoch, self.store.end_offset)}

    def _check_epoch(self, epoch: int) -> None:
        if epoch > self.epoch:
            self.on_newer_epoch(epoch)
            raise RemoteError(ErrorCode.NOT_MASTER, f"epoch {epoch} is newer than this master's {self.epoch}")
        if self._closed:
            raise RemoteError(ErrorCode.NOT_MASTER, "this server is no longer master")

    def _shippable(self) -> int:
        return self.store.end_offset

    async def _wait_appended(self) -> None:
        await self._appended.wait()

    def _on_append(self, end: int) -> None:
        if threading.get_ident() == self._loop_thread:
            self._appended.set()
        else:
            self._loop.call_soon_threadsafe(self._appended.set)

    # ---- reporting ------------------------------------------------------------------------------

    def stats(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        end = self.store.end_offset
        in_sync = set(self.in_sync(now))
        counted = None if self.counted is None else self.counted()
        return [
            {
                "address": r.address,
                "in_sync": r.address in in_sync,
                # its durable offset acknowledges sends (the meta server holds it as in sync)
                "acknowledges": counted is None or r.address in counted,
                "offset": r.offset,
                "lag_bytes": r.lag_bytes(end),
                "lag_s": round(r.lag_s(end, now), 3),
                "last_fetch_s": round(now - r.fetched_at, 3),
            }
            for r in sorted(self.replicas.values(), key=lambda r: r.address)
        ]
