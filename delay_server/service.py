"""The delay server's request handler and the path of a delayed message to its bucket.

DELAY_SEND: each message is checked on its own (as BROKER_SEND), its due time is its `deliver_at`,
or now if that is past; messages due beyond `max_delay` are refused. Sends of one loop iteration are
appended to the message log together; once durable they are filed into their buckets (in
message-log order, so a bucket never holds an entry twice after a crash, see schedule_log.py), then
the sender is answered. DELAY_CANCEL records cancels the same way. A checkpoint every second
fsyncs the buckets, cancels and dispatch logs and records how far the message log is filed.

What a broker acknowledged is noted in the message log too (a dispatch note, records.py), after the
scheduler wrote it to the bucket's dispatch log; filing a note writes it to the dispatch log, so the
log alone says what is pending, cancelled and delivered. In a replicated group (docs/replication.md)
a master answers a send or cancel only once enough replicas hold it too (`acknowledged`), and is
`read_only` when too few are in sync; a replica files what it copies (`catch_up`), so a promoted
replica only loads its buckets into the wheel.

At start, `recover` files again what the message log holds after the last checkpoint (a replica
that copied the master's schedule, snapshot.py, files nothing until its log passes the copy's end).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from delay_server import metrics, records
from delay_server.cancels import Cancels
from delay_server.clock import Clock
from delay_server.dispatch_log import DONE_SUFFIX, append_to, mark_done_file
from delay_server.schedule_log import ScheduleLog, bucket_name
from delay_server.scheduler import Scheduler
from qmq.ids import new_id
from qmq.net.service import Service
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.fields import bad, field
from qmq.protocol.limits import DEFAULT_LIMITS, MAX_MESSAGE_ID_LEN, Limits, validate_sent_message, validate_subject
from qmq.store.disk_space import is_out_of_space, space_available
from qmq.store.flush import FlushFailed
from qmq.store.group_commit import GroupCommit, Written
from qmq.store.store import Appended, LogStore, Message, StoreError

log = logging.getLogger("qmq.delay")

DEFAULT_MAX_DELAY_S = 730 * 86400  # two years
CHECKPOINT_INTERVAL_S = 1.0
REPLAY_BUFFER_BYTES = 8 * 1024 * 1024  # copies held during recovery before they are written out
MAX_CANCEL_IDS = 4096
DAY_MS = 86_400_000
_DUE_PACK = records.DUE.pack


async def _nothing_to_wait_for(end: int) -> None:
    return None


def iso(ms: int) -> str:
    """`ms` since the epoch in ISO 8601, or a plain count for a time no calendar date can hold (a
    client may send any integer: the error naming it must not fail)."""
    try:
        return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
    except (ValueError, OverflowError, OSError):
        return f"{ms} ms since the epoch"


class DelayService(Service):
    name = "delay server"
    log = log
    storage_errors = (StoreError, FlushFailed)

    def __init__(
        self,
        store: LogStore,
        schedule: ScheduleLog,
        cancels: Cancels,
        scheduler: Scheduler,
        clock: Clock,
        *,
        max_delay_s: float = DEFAULT_MAX_DELAY_S,
        limits: Limits = DEFAULT_LIMITS,
    ) -> None:
        super().__init__(metrics.REQUESTS)
        self.store = store
        self.schedule = schedule
        self.cancels = cancels
        self.scheduler = scheduler
        self.clock = clock
        self.max_delay_ms = int(max_delay_s * 1000)
        self.limits = limits
        self.filed_upto = store.end_offset  # everything before is in its bucket (after recover)
        self.failed: BaseException | None = None  # filing into the buckets failed: refuse until restarted
        self.read_only = False  # a replicated master with too few replicas in sync: sends go elsewhere
        # A replicated group's master waits here until enough replicas hold a write (qmq/replication/roles.py).
        self.acknowledged: Callable[[int], Awaitable[None]] = _nothing_to_wait_for
        self._dispatch_dirty: set[Path] = set()  # dispatch logs written by filing notes
        self._filing: asyncio.Future[None] | None = None  # a replica's filing thread (catch_up)
        # Sends and cancels of one loop iteration: one append, one durability wait, then filed.
        self.group_commit = GroupCommit(store, on_durable=self._file_durable)
        self._valid_subjects: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []
        self.handlers |= {
            RequestCode.DELAY_SEND: self._send,
            RequestCode.DELAY_CANCEL: self._cancel,
            RequestCode.DELAY_STATS: self._stats,
            RequestCode.DELAY_LOOKUP: self._lookup,
        }

    # ---- recovery, background, stop ---------------------------------------------------------------

    def recover(self) -> int:
        """File into the buckets what the message log holds after the schedule checkpoint (a crash
        may have left it unfiled or half-filed); how many records. Blocking: run it before serving."""
        start = self.schedule.checkpoint_offset
        if start > self.store.end_offset:  # a copy of the master's schedule (snapshot.py), its log still coming
            self.filed_upto = start
            log.info("schedule log filed up to %d (a copy of the master's): the log is copied up to there", start)
            return 0
        if start < self.store.start_offset:
            log.error(
                "the message log from %d was removed before it was filed into the schedule log (filed up to "
                "%d): messages in between are lost",
                self.store.start_offset,
                start,
            )
            start = self.store.start_offset
        replayed, touched = self._file_log(start)
        end = self.store.end_offset
        self.schedule.save_checkpoint(end, self._take_dirty())
        self.filed_upto = end
        log.info(
            "schedule log recovered: %d records after the checkpoint filed again into %d buckets", replayed, touched
        )
        return replayed

    async def catch_up(self, end: int) -> None:
        """A replica's message log is durable up to `end`: file what it holds after what is filed
        (delayed messages into their buckets, cancels, dispatch notes into the dispatch logs). The
        checkpoint loop makes it durable, as on a master. The filing runs in a thread that neither
        a checkpoint nor `close` overlaps (`_filing_done`), even when the caller is cancelled."""
        if end <= self.filed_upto:
            return
        await self._filing_done()
        self._filing = asyncio.ensure_future(asyncio.to_thread(self._file_upto, end))
        await asyncio.shield(self._filing)

    def _file_upto(self, end: int) -> None:
        self._file_log(self.filed_upto, end)
        self.filed_upto = end

    async def _filing_done(self) -> None:
        """Wait for a replica's filing thread, if one runs (its error is its caller's)."""
        if self._filing is not None and not self._filing.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(self._filing)

    def _file_log(self, start: int, end: int | None = None) -> tuple[int, int]:
        """File the records of the message log from `start` (to `end`, else its end): (how many,
        how many buckets they touched). Each bucket touched is first cut back to its entries before
        `start`, so nothing is filed twice. Blocking."""
        cut: set[int] = set()
        pending: dict[int, list[tuple[int, int, bytes]]] = defaultdict(list)
        cancels: list[tuple[int, str, int]] = []
        replayed = buffered = 0
        for record in self.store.scan(start):
            if end is not None and record.offset >= end:
                break
            replayed += 1
            if record.flags & records.DISPATCHED:
                self._append_replayed(pending)  # the note names positions filed before it
                buffered = 0
                bucket_start, positions = records.dispatched_positions(record.payload)
                self._dispatch_dirty.add(append_to(self.scheduler.dispatch_dir, bucket_start, positions))
            elif record.flags & records.BUCKET_DONE:
                bucket_start = records.due_of(record.payload)
                mark_done_file(self.scheduler.dispatch_dir, bucket_start)
                self._dispatch_dirty.add(self.scheduler.dispatch_dir)
                self.scheduler.done.add(bucket_start)
            elif record.flags & records.CANCEL:
                cancels.append((record.offset, record.message_id, records.due_of(record.payload)))
            elif record.flags & records.DELAYED:
                due = records.due_of(record.payload)
                bucket_start = self.schedule.start_of(due)
                if bucket_start in self.scheduler.done:  # a message for a bucket retired just before
                    (self.scheduler.dispatch_dir / (bucket_name(bucket_start) + DONE_SUFFIX)).unlink(missing_ok=True)
                    self.scheduler.done.discard(bucket_start)
                if bucket_start not in cut:
                    bucket = self.schedule.bucket(bucket_start, create=True)
                    assert bucket is not None
                    dropped = bucket.cut_from(start)
                    if dropped:
                        log.info(
                            "bucket %s: %d entries after the checkpoint cut, to be filed again", bucket.name, dropped
                        )
                    cut.add(bucket_start)
                pending[bucket_start].append((record.offset, due, self.store.read_bytes(record.offset, record.end)))
                buffered += record.size
                if buffered >= REPLAY_BUFFER_BYTES:
                    self._append_replayed(pending)
                    buffered = 0
        self._append_replayed(pending)
        if cancels:
            self.cancels.add(cancels)
        return replayed, len(cut)

    def _take_dirty(self) -> list[Path]:
        dispatch, self._dispatch_dirty = list(self._dispatch_dirty), set()
        return self.schedule.take_dirty() + self.cancels.take_dirty() + dispatch

    def _append_replayed(self, pending: dict[int, list[tuple[int, int, bytes]]]) -> None:
        for bucket_start, items in pending.items():
            self.schedule.append(bucket_start, items)
        pending.clear()

    def start(self) -> None:
        self._tasks.append(asyncio.create_task(self._checkpoint_loop()))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await asyncio.sleep(0)  # the dispatch notes of the last deliveries get appended
        await self.group_commit.close()  # file what requests cut short appended
        await self.checkpoint()  # after a replica's filing thread, if one runs

    async def checkpoint(self) -> None:
        """Fsync what was filed and delivered, and record how far the message log is filed."""
        await self._filing_done()
        offset = self.filed_upto
        dirty = self._take_dirty() + self.scheduler.take_dirty()
        if offset == self.schedule.checkpoint_offset and not dirty:
            return
        await asyncio.to_thread(self.schedule.save_checkpoint, offset, dirty)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_INTERVAL_S)
            self._refile_when_space()
            try:
                await self.checkpoint()
            except Exception:
                log.exception("schedule checkpoint failed; the next one tries again (a restart replays more)")

    # ---- requests ---------------------------------------------------------------------------------

    async def _send(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = field(body, "messages", list)
        self._check_healthy()
        if self.read_only:
            raise RemoteError(ErrorCode.READ_ONLY, "this delay server's group cannot replicate now: send elsewhere")
        now = self.clock.now_ms()
        batch: list[Message] = []
        rejected: list[list[Any]] = []
        for index, item in enumerate(messages):
            try:
                batch.append(self._message(item, now))
            except ProtocolError as exc:
                rejected.append([index, int(exc.code), exc.message])
        stored = len(batch)
        batch = [m for m in batch if not self._already_stored(m)]
        if batch:
            await self._append_and_file(batch)
        return {"stored": stored, "rejected": rejected}

    def _already_stored(self, message: Message) -> bool:
        """A message this server already holds (same id and subject): a producer sending again after
        losing the reply, as when this server was killed between storing and answering. Storing it
        again would schedule and deliver it twice; it is answered as stored instead. (A few reads
        through the key index; a message whose record retention removed is stored again.)"""
        record = self.store.find_by_id(message.message_id)
        return record is not None and bool(record.flags & records.DELAYED) and record.subject == message.subject

    def _message(self, item: Any, now: int) -> Message:
        """The message to append, or a ProtocolError saying why not."""
        m = validate_sent_message(item, self.limits, self._valid_subjects)
        message_id = m.id
        deliver_at = item.get("deliver_at")
        if type(deliver_at) is not int:
            raise bad(f"message {message_id}: deliver_at must be ms since the epoch")
        if deliver_at > now + self.max_delay_ms:
            raise bad(
                f"message {message_id}: deliver_at {iso(deliver_at)} is {(deliver_at - now) / DAY_MS:.1f} "
                f"days ahead; this delay server takes at most {self.max_delay_ms / DAY_MS:g} days"
            )
        return Message(
            m.subject, message_id, _DUE_PACK(max(deliver_at, now)) + m.payload, m.key, m.tags, records.DELAYED
        )

    async def _cancel(self, body: dict[str, Any]) -> dict[str, Any]:
        ids = field(body, "ids", list, what="a list of message ids")
        if not all(isinstance(i, str) and 0 < len(i.encode()) <= MAX_MESSAGE_ID_LEN for i in ids):
            raise bad(f"field 'ids' must be a list of message ids (strings of 1-{MAX_MESSAGE_ID_LEN} bytes)")
        if len(ids) > MAX_CANCEL_IDS:
            raise bad(f"field 'ids' holds {len(ids)} ids, at most {MAX_CANCEL_IDS} are taken per request")
        self._check_healthy()
        now = self.clock.now_ms()
        outcomes, batch = [], []
        keep_until = now + self.max_delay_ms
        for message_id in ids:
            outcome = self._cancel_outcome(message_id, now)
            outcomes.append(outcome)
            if outcome != "too_late" and message_id not in self.cancels:
                batch.append(records.cancel(message_id, keep_until))
        for message in batch:  # from now on the wheel holds these back until the cancel is durable
            self.scheduler.cancelling[message.message_id] = self.scheduler.cancelling.get(message.message_id, 0) + 1
        try:
            if batch:
                await self._append_and_file(batch)
        finally:
            for message in batch:
                left = self.scheduler.cancelling.pop(message.message_id) - 1
                if left:
                    self.scheduler.cancelling[message.message_id] = left
        if batch:
            log.info("%d messages cancelled", len(batch))
        return {"outcomes": outcomes}

    def _cancel_outcome(self, message_id: str, now: int) -> str:
        """ "too_late" when the message was due already; "cancelled" when it is pending (or already
        cancelled); "unknown" when the message log no longer (or never) had it, in which case the
        cancel is recorded anyway: the message may be older than the log's retention."""
        record = self.store.find_by_id(message_id)
        if record is None:
            return "cancelled" if message_id in self.cancels else "unknown"
        if record.flags & records.CANCEL:
            return "cancelled"
        return "too_late" if records.due_of(record.payload) <= now else "cancelled"

    async def _stats(self, body: dict[str, Any]) -> dict[str, Any]:
        stats = self.scheduler.stats()
        stats["max_delay_ms"] = self.max_delay_ms
        stats["filed_upto"] = self.filed_upto
        # the store's reason (disk full: until space is freed; I/O or fsync error: until restarted),
        # or the schedule log's (until restarted, which files from the message log)
        reason = (
            self.store.read_only_reason
            or (f"the schedule log could not be written: {self.failed}" if self.failed is not None else None)
            or ("its replicated group cannot replicate now (replication.replicas)" if self.read_only else None)
        )
        stats["read_only"] = reason is not None
        stats["read_only_reason"] = reason
        return stats

    async def _lookup(self, body: dict[str, Any]) -> dict[str, Any]:
        """DELAY_LOOKUP (`qmq admin lookup`): the delayed messages with this "id", or with this
        "subject" and "key", and where each stands: "pending" (due later), "cancelled", "delivered"
        (its bucket is done) or "due" (due, delivered or being delivered: the brokers know which)."""
        if body.get("id") is not None:
            message_id = field(body, "id", str)
            found = await asyncio.to_thread(self.store.find_all_by_id, message_id)
        else:
            subject = validate_subject(field(body, "subject", str), limits=self.limits)
            found = await asyncio.to_thread(self.store.find_by_key, subject, field(body, "key", str))
        now = self.clock.now_ms()
        messages = []
        for record in found:
            if not record.flags & records.DELAYED:
                continue
            due = records.due_of(record.payload)
            if record.message_id in self.cancels:
                state = "cancelled"
            elif due > now:
                state = "pending"
            elif self.schedule.start_of(due) in self.scheduler.done:
                state = "delivered"
            else:
                state = "due"
            messages.append(
                {
                    "id": record.message_id,
                    "subject": record.subject,
                    "key": record.key,
                    "tags": list(record.tags),
                    "payload": records.body_of(record.payload),
                    "stored_at": record.store_ts,
                    "deliver_at": due,
                    "state": state,
                }
            )
        return {"messages": messages}

    def _check_healthy(self) -> None:
        if self.failed is not None:
            raise RemoteError(
                ErrorCode.UNAVAILABLE,
                f"the delay server could not write its schedule log and takes nothing until "
                f"{'space is freed' if is_out_of_space(self.failed) else 'restarted'}: {self.failed}",
            )

    # ---- from the message log into the buckets ----------------------------------------------------

    async def _append_and_file(self, batch: list[Message]) -> None:
        """Append `batch` with the other requests of this loop iteration (one store append, one
        durability wait); return once it is filed into its buckets."""
        appended = await self.group_commit.write(batch)
        self._check_healthy()
        await self.acknowledged(appended[-1].end)  # a replicated group: enough replicas have it

    def note_dispatched(self, bucket_start_ms: int, positions: list[int]) -> None:
        """The scheduler's deliveries a broker acknowledged: noted in the message log (not waited
        for: a note lost in a crash means those messages are delivered again, which the brokers
        drop as already stored)."""
        self._note(records.dispatched(new_id(), bucket_start_ms, positions))

    def note_done(self, bucket_start_ms: int) -> None:
        """The scheduler marked a bucket done: noted in the message log, so replicas mark it too."""
        self._note(records.bucket_done(new_id(), bucket_start_ms))

    def _note(self, message: Message) -> None:
        self.group_commit.write([message]).add_done_callback(_log_note_failure)

    async def retire(self) -> None:
        """A replica's retention, as the master's loader does it: delete done buckets past the
        retention (between filing threads)."""
        await self._filing_done()
        self.scheduler.retire_old()

    def _file_durable(self, written: Written) -> None:
        """File durable messages (and cancels), called in message-log order. After a failure, nothing
        more is filed: a restart files it from the message log."""
        if self.failed is not None:
            return
        try:
            self._file(written)
        except Exception as exc:
            self.failed = exc
            log.critical(
                "cannot write the schedule log; refusing new messages until %s: %s",
                "space is freed" if is_out_of_space(exc) else "restarted (a restart files them from the message log)",
                exc,
            )
            return
        self.filed_upto = written[-1][0].end

    def _refile_when_space(self) -> None:
        """After a schedule-log write failed for want of space: once space is back, file what the
        message log holds from where filing stopped (its buckets cut back first, so nothing is filed
        twice; what a broker may then get twice it drops, `once`) and take requests again. Any other
        write error still needs a restart, which files the same from the message log."""
        if self.failed is None or not is_out_of_space(self.failed) or not space_available(self.store.data_dir):
            return
        start, end = self.filed_upto, self.group_commit.settled_upto()
        items: Written = []
        for record in self.store.scan(start):
            if record.offset >= end:
                break
            message = Message(record.subject, record.message_id, record.payload, record.key, record.tags, record.flags)
            items.append((Appended(record.offset, record.seq, record.end), message))
        try:
            for bucket_start in {self.schedule.start_of(records.due_of(m.payload)) for _, m in items if _filed(m)}:
                bucket = self.schedule.bucket(bucket_start, create=False)
                if bucket is not None:
                    bucket.cut_from(start)
            if items:
                self._file(items)
        except Exception as exc:
            self.failed = exc
            log.warning("the schedule log still cannot be written: %s", exc)
            return
        self.filed_upto = end
        self.failed = None
        log.warning("the schedule log takes writes again: %d records filed from offset %d", len(items), start)

    def _file(self, items: Written) -> None:
        """File appended messages (and cancels) into their buckets. The copies are the message-log
        records themselves, read back from the page cache in one read."""
        by_bucket: dict[int, list[tuple[int, int, memoryview]]] = defaultdict(list)
        cancels = []
        first = items[0][0].offset
        raw = memoryview(self.store.read_bytes(first, items[-1][0].end))
        bucket_ms, due_of, cancel_flag = self.schedule.bucket_ms, records.due_of, records.CANCEL
        notes = records.NOTES
        for appended, message in items:
            offset = appended.offset
            if message.flags & notes:
                continue  # the scheduler wrote the dispatch log (or marked the bucket) before noting it
            due = due_of(message.payload)
            if message.flags & cancel_flag:
                cancels.append((offset, message.message_id, due))
            else:
                by_bucket[due - due % bucket_ms].append((offset, due, raw[offset - first : appended.end - first]))
        for bucket_start, entries in by_bucket.items():
            _bucket, positions = self.schedule.append(bucket_start, entries)
            self.scheduler.scheduled(bucket_start, zip(positions, (due for _, due, _ in entries), strict=True))
        if cancels:
            self.cancels.add(cancels)


def _filed(message: Message) -> bool:
    """A delayed message, filed into a bucket (not a cancel or a note)."""
    return bool(message.flags & records.DELAYED) and not message.flags & (records.CANCEL | records.NOTES)


def _log_note_failure(future: asyncio.Future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning(
            "a dispatch note could not be written (after a failover those messages are sent again): %s",
            future.exception(),
        )
