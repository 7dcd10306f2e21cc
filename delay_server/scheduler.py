"""Loading buckets into the wheel, firing what is due, delivering it to brokers, and retiring buckets.

- **Loading**: a bucket is loaded once it begins less than `load_ahead` from now (30 minutes by
  default), in a thread: its index is read (32 bytes per message), the messages the dispatch log
  names are left out, and the rest go into the wheel by tick. Messages scheduled into a bucket that
  is loaded (or loading) go straight into the wheel.
- **Firing**: when a tick begins, its messages are read from the bucket (full copies) and held
  until their due millisecond, then delivered; a message whose id was cancelled is dropped. At most
  `max_held` messages are read and not yet delivered at once: after an outage or a restart with a
  backlog due, the rest wait in the wheel (8 bytes each) until deliveries make room, so the
  messages in memory (a count, not bytes) and the event loop's turns stay bounded however much
  came due.
- **Delivering**: through `AsyncClient`, in batches, to a writable broker group of the subject (the
  client tries another group on failure); what a broker acknowledged is written to the dispatch
  log and noted in the message log (`on_dispatched`); what failed is tried again, forever: with its
  subject's other messages when no broker would take that subject (parking.py), else after a backoff
  of its own.
- **Retiring**: a bucket whose time is over and whose every message was delivered or cancelled is
  marked done and unloaded; its files are deleted after the retention.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import logging
import os
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from delay_server import dispatch_log, records
from delay_server.cancels import Cancels
from delay_server.clock import CLOCK_POLL_S, Clock
from delay_server.dispatch_log import DispatchLog
from delay_server.parking import Parking
from delay_server.schedule_log import (
    INDEX_SIZE,
    INDEX_SUFFIX,
    Bucket,
    ScheduleError,
    ScheduleLog,
    bucket_name,
    parse_bucket_name,
)
from delay_server.wheel import TICK_MS, Wheel, ref, split_ref, tick_of
from qmq.client.aio import AsyncClient
from qmq.client.messages import ForwardedMessage
from qmq.client.sending import RETRIABLE_SEND_CODES
from qmq.metrics import Histogram
from qmq.store import record as rec

log = logging.getLogger("qmq.delay")

DEFAULT_LOAD_AHEAD_S = 30 * 60
DEFAULT_RETENTION_S = 72 * 3600  # delivered buckets are kept this long after they end
DELIVERY_BATCH = 1024  # messages in one AsyncClient.send call, at most
DELIVERERS = 8  # send calls in flight at once; each takes whatever is due when it is free (batches grow with load)
OUT_OF_OFFICE_POLL_S = 0.05  # how often a fenced or handing-off master looks whether it may deliver again
# Due messages read from their buckets and not yet delivered (held until their millisecond, waiting for
# a deliverer, or being sent), at most; twice what the deliverers send at once.
DEFAULT_MAX_HELD = 2 * DELIVERERS * DELIVERY_BATCH
# after the n-th failed delivery of a message refused for itself (its subject's brokers took others); the last repeats
RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
LOAD_POLL_S = 1.0  # how often the loader looks for buckets coming due
RETENTION_POLL_S = 60.0
CLOSE_GRACE_S = 5.0  # at shutdown, deliveries in flight get this long to finish
LATENESS_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 3600.0)


@dataclass(eq=False)
class LoadedBucket:
    start_ms: int
    end_ms: int
    slot: int
    reader: Bucket  # its own descriptors: the schedule log's may be closed by its LRU
    dispatch: DispatchLog
    pending: int = 0  # in the wheel, held until due, being delivered or waiting for a retry
    loading: bool = True
    delivered: list[int] = field(default_factory=list)  # positions acknowledged, not yet in the dispatch log

    @property
    def name(self) -> str:
        return self.reader.name


class Scheduler:
    def __init__(
        self,
        schedule: ScheduleLog,
        dispatch_dir: Path,
        cancels: Cancels,
        clock: Clock,
        client: AsyncClient | None,
        *,
        load_ahead_s: float = DEFAULT_LOAD_AHEAD_S,
        retention_s: float = DEFAULT_RETENTION_S,
        max_held: int = DEFAULT_MAX_HELD,
    ) -> None:
        if max_held < 1:
            raise ValueError("max_held must be at least 1")
        self.schedule = schedule
        self.dispatch_dir = dispatch_dir
        self.cancels = cancels
        self.clock = clock
        self.client = client
        if client is not None:  # a subject whose brokers fail is parked and probed (parking.py), not
            client.delivery_timeout_s = 0.0  # waited for in a send: the other subjects go on meanwhile
        self.load_ahead_ms = int(load_ahead_s * 1000)
        self.retention_ms = int(retention_s * 1000)
        self.max_held = max_held
        self.held_peak = 0  # the most messages held at once (stats: the bound at work)
        self._fire_now_ms = 0  # the clock as the fire loop last read it
        self.wheel = Wheel()
        self.loaded: dict[int, LoadedBucket] = {}  # by bucket start
        self._by_slot: dict[int, LoadedBucket] = {}
        self._next_slot = 0
        self.done: set[int] = set()  # buckets whose every message was delivered or cancelled
        dispatch_dir.mkdir(parents=True, exist_ok=True)
        for path in dispatch_dir.glob("*" + dispatch_log.DONE_SUFFIX):
            start = parse_bucket_name(path.name[: -len(dispatch_log.DONE_SUFFIX)])
            if start is not None:
                self.done.add(start)
        self.cancelling: dict[str, int] = {}  # ids whose cancel is not durable yet -> requests
        # (bucket start, positions) a broker acknowledged, after the dispatch log has them: the service
        # notes them in the message log
        self.on_dispatched: Callable[[int, list[int]], None] = lambda start_ms, positions: None
        self.on_done: Callable[[int], None] = lambda start_ms: None  # a bucket marked done: noted too
        self._staged: list[tuple[int, int, rec.Record]] = []  # (due ms, ref, record), a heap
        self._attempts: dict[int, int] = {}  # ref -> failed deliveries, for the backoff
        self.parking = Parking()  # messages of subjects no broker would take, probed (parking.py)
        self.counters = {"scheduled": 0, "fired": 0, "skipped": 0, "failures": 0}
        self.lateness = Histogram(LATENESS_BUCKETS_S)  # delivery time minus due time, seconds
        self._wake = asyncio.Event()
        self._loader_wake = asyncio.Event()
        self._outbox: deque[tuple[int, int, rec.Record]] = deque()  # due, waiting for a free deliverer
        self._outbox_ready = asyncio.Event()
        self._deliverers: list[asyncio.Task[None]] = []
        self._delivering = 0  # deliverers busy sending
        self._sending = 0  # messages those deliverers hold
        self._tasks: list[asyncio.Task[None]] = []
        # Whether this server may deliver now (a replicated group's master that is not fenced nor
        # handing off: else a promoted replica may be firing the same messages at the same moment,
        # and two copies arriving together are both stored, qmq/broker/dedupe.py).
        self.in_office: Callable[[], bool] = lambda: True
        self._out_of_office_logged = False

    # ---- start and stop ---------------------------------------------------------------------

    def start(self) -> None:
        for coro in (self._fire_loop(), self._load_loop(), self._clock_loop()):
            self._tasks.append(asyncio.create_task(coro))
        self._deliverers = [asyncio.create_task(self._deliver_loop()) for _ in range(DELIVERERS)]

    async def close(self) -> None:
        """Stop firing; give deliveries in flight a moment to finish (the rest are delivered again
        after the restart: they are not in the dispatch log)."""
        for task in self._tasks:
            task.cancel()
        self._outbox.clear()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_GRACE_S
        while self._delivering and loop.time() < deadline:
            await asyncio.sleep(0.05)
        for task in [*self._tasks, *self._deliverers]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._flush_delivered()
        for lb in self.loaded.values():
            lb.reader.close()
            lb.dispatch.close()

    # ---- scheduling ---------------------------------------------------------------------------

    def scheduled(self, start_ms: int, items: Iterable[tuple[int, int]]) -> None:
        """Messages (position in the bucket's .log, due ms) were appended to bucket `start_ms`."""
        items = list(items)
        self.counters["scheduled"] += len(items)
        if start_ms in self.done:  # a message for a bucket that was just retired: take it back
            self.done.discard(start_ms)
            (self.dispatch_dir / (bucket_name(start_ms) + dispatch_log.DONE_SUFFIX)).unlink(missing_ok=True)
            self._loader_wake.set()
        lb = self.loaded.get(start_ms)
        if lb is None:
            if start_ms < self.clock.now_ms() + self.load_ahead_ms:
                self._loader_wake.set()  # a bucket coming due got its first message: load it now
            return
        earliest = self.wheel.next_tick()
        add, slot_bits, first = self.wheel.add, ref(lb.slot, 0), None
        for position, due_ms in items:
            tick = due_ms // TICK_MS
            add(tick, slot_bits | position)
            if first is None or tick < first:
                first = tick
        if first is not None and (earliest is None or first < earliest):
            self._wake.set()
        lb.pending += len(items)

    # ---- loading ------------------------------------------------------------------------------

    async def _load_loop(self) -> None:
        next_retention = 0.0
        loop = asyncio.get_running_loop()
        while True:
            self._loader_wake.clear()
            try:
                await self.load_due()
                if loop.time() >= next_retention:
                    self.retire_old()
                    next_retention = loop.time() + RETENTION_POLL_S
            except Exception:
                log.exception("loading buckets failed; trying again in %g s", LOAD_POLL_S)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(LOAD_POLL_S):
                    await self._loader_wake.wait()

    async def load_due(self) -> int:
        """Load every bucket that begins before now + load-ahead; retire loaded ones that are over.
        How many were loaded."""
        horizon = self.clock.now_ms() + self.load_ahead_ms
        loaded = 0
        for start in sorted(self.schedule.starts):
            if start >= horizon:
                break
            if start not in self.loaded and start not in self.done:
                await self._load(start)
                loaded += 1
        for lb in list(self.loaded.values()):
            self._check_done(lb)
        return loaded

    async def _load(self, start_ms: int) -> None:
        count = self.schedule.count(start_ms)  # entries appended later go straight into the wheel
        slot = self._next_slot
        self._next_slot += 1
        lb = LoadedBucket(
            start_ms,
            start_ms + self.schedule.bucket_ms,
            slot,
            Bucket(self.schedule.directory, start_ms),
            DispatchLog(self.dispatch_dir, start_ms),
        )
        self.loaded[start_ms] = lb
        self._by_slot[slot] = lb
        try:
            ticks, pending, delivered = await asyncio.to_thread(_read_bucket, lb, count)
        except BaseException:
            del self.loaded[start_ms], self._by_slot[slot]
            lb.reader.close()
            lb.dispatch.close()
            raise
        for tick, values in ticks.items():
            self.wheel.add_many(tick, values)
        lb.pending += pending
        lb.loading = False
        release_free_memory()
        self._wake.set()
        log.info("bucket %s loaded: %d messages pending, %d already delivered", lb.name, lb.pending, delivered)

    def _check_done(self, lb: LoadedBucket) -> None:
        if lb.loading or lb.pending or self.clock.now_ms() < lb.end_ms:
            return
        self._flush_delivered()
        lb.dispatch.mark_done()
        lb.reader.close()
        lb.dispatch.close()
        del self.loaded[lb.start_ms], self._by_slot[lb.slot]
        self.done.add(lb.start_ms)
        self.on_done(lb.start_ms)
        log.info("bucket %s done: every message delivered or cancelled", lb.name)

    def retire_old(self) -> None:
        """Delete done buckets older than the retention, and cancels no message can need any more."""
        now = self.clock.now_ms()
        for start in sorted(self.done):
            if start + self.schedule.bucket_ms + self.retention_ms > now:
                break
            self.schedule.remove(start)
            dispatch_log.remove(self.dispatch_dir, start)
            self.done.discard(start)
            log.info("retention: deleted bucket %s", bucket_name(start))
        self.cancels.expire(now)

    # ---- firing -------------------------------------------------------------------------------

    @property
    def held(self) -> int:
        """Due messages read from their buckets and not yet delivered (at most `max_held`, but for
        probes of parked subjects)."""
        return len(self._staged) + len(self._outbox) + self._sending

    def due_waiting(self) -> int:
        """Due messages left in the wheel because `max_held` are held (0 while there is room: the
        fire loop reads what is due at once). Scans the wheel's slots: for stats, not the loop."""
        if self.held < self.max_held:
            return 0
        return self.wheel.due_count(self.clock.now_ms() // TICK_MS)

    async def _fire_loop(self) -> None:
        while True:
            self._wake.clear()
            now = self.clock.now_ms()
            if now < self._fire_now_ms:
                self._unstage()  # the clock stepped back: what is held may not be due for a while
            self._fire_now_ms = now
            for probe in self.parking.due_probes(now):
                self._stage(probe)
            for values in self.parking.due_released(now):
                self.wheel.add_many(now // TICK_MS, values)
            room = self.max_held - self.held
            if room > 0:
                for slot in self.wheel.take_due(now // TICK_MS, room):
                    self._stage(slot)
            self.held_peak = max(self.held_peak, self.held)
            due = []
            staged = self._staged
            while staged and staged[0][0] <= now:
                due.append(heapq.heappop(staged))
            if due:
                self._fire(due, now)
            wake_at = []
            if len(self.wheel) and self.held < self.max_held:  # when full, a finished delivery wakes it
                wake_at.append(self.wheel.next_tick() * TICK_MS)
            if staged:
                wake_at.append(staged[0][0])
            if (probe_at := self.parking.next_probe_ms()) is not None:
                wake_at.append(probe_at)
            if (release_at := self.parking.next_release_ms(now)) is not None:
                wake_at.append(release_at)
            timeout = max(0.0, (min(wake_at) - self.clock.now_ms()) / 1000) if wake_at else None
            if timeout == 0.0:
                await asyncio.sleep(0)
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _unstage(self) -> None:
        """Give the messages held until their millisecond back to the wheel (read again when due),
        so that they do not fill `max_held` ahead of messages due sooner."""
        for due_ms, value, _ in self._staged:
            self.wheel.add(tick_of(due_ms), value)
        self._staged = []

    def _stage(self, slot: array) -> None:
        """Read the messages of a tick that began; they wait in a heap for their due millisecond."""
        for value in slot:
            bucket_slot, position = split_ref(value)
            lb = self._by_slot[bucket_slot]
            try:
                record = lb.reader.read_record(position)
            except ScheduleError as exc:
                log.error("cannot read a due message, it is not delivered: %s", exc)
                lb.pending -= 1
                continue
            heapq.heappush(self._staged, (records.due_of(record.payload), value, record))

    def _fire(self, due: list[tuple[int, int, rec.Record]], now: int) -> None:
        send = []
        for item in due:
            record = item[2]
            if record.message_id in self.cancels:
                self.counters["skipped"] += 1
                lb = self._by_slot[split_ref(item[1])[0]]
                lb.pending -= 1
                self._check_done(lb)
            elif record.message_id in self.cancelling:  # its cancel is being written: decide next tick
                self.wheel.add(tick_of(now) + 1, item[1])
            else:
                send.append(item)
        if send:
            self._outbox.extend(send)
            self._outbox_ready.set()

    async def _deliver_loop(self) -> None:
        while True:
            await self._outbox_ready.wait()
            await self._until_in_office()  # not counted as delivering: `close` need not wait for it
            outbox = self._outbox
            items = [outbox.popleft() for _ in range(min(DELIVERY_BATCH, len(outbox)))]
            if not outbox:
                self._outbox_ready.clear()
            if items:
                self._delivering += 1
                self._sending += len(items)
                try:
                    await self._deliver(items)
                except Exception:  # keep the deliverer (8 dead ones would stop every delivery)
                    # Not tried again here: part of the batch may be counted delivered already. What
                    # the dispatch log does not name is delivered after a restart (recover()).
                    log.exception(
                        "delivery of %d messages failed unexpectedly; those not recorded as "
                        "delivered go after a restart",
                        len(items),
                    )
                    self._wake.set()  # it may have put messages back in the wheel before it failed
                finally:
                    self._delivering -= 1
                    self._sending -= len(items)
                    if self.held + len(items) >= self.max_held:  # the fire loop may wait for room
                        self._wake.set()

    async def _until_in_office(self) -> None:
        """Wait while this master may not deliver: it lost the meta server (fenced) or hands its
        group over. It is told again (a meta reply) or steps down (`close` cancels the wait: what it
        held is fired by the next master, or after a restart)."""
        if self.in_office():
            return
        if not self._out_of_office_logged:
            self._out_of_office_logged = True
            log.warning(
                "fenced or handing off: delivering nothing until the meta server answers or a replica takes over"
            )
        while not self.in_office():
            await asyncio.sleep(OUT_OF_OFFICE_POLL_S)  # the fence ends with a meta reply: a matter of time
        if self._out_of_office_logged:  # one line however many deliverers waited
            self._out_of_office_logged = False
            log.info("delivering again")

    async def _deliver(self, items: list[tuple[int, int, rec.Record]]) -> None:
        messages = [
            ForwardedMessage(
                r.subject, None, key=r.key, tags=r.tags, id=r.message_id, payload=records.body_of(r.payload)
            )
            for _, _, r in items
        ]
        sent_ms = self.clock.now_ms()
        try:
            assert self.client is not None, "the scheduler has no client to deliver with"
            results = await self.client.send(messages)
            errors = [None if r.ok else (r.error_code, r.error or "not stored") for r in results]
        except Exception as exc:  # the client promises results, not exceptions; be safe all the same
            errors = [(None, repr(exc))] * len(items)
        now = self.clock.now_ms()
        touched: set[LoadedBucket] = set()
        stored: set[str] = set()  # subjects a broker took messages of
        unreachable: dict[str, list[int]] = {}  # subject -> its messages no broker would take now
        why: dict[str, str] = {}  # subject -> the first such error
        refused: list[tuple[int, str]] = []
        for (due_ms, value, record), error in zip(items, errors, strict=True):
            lb = self._by_slot[split_ref(value)[0]]
            touched.add(lb)
            if error is None:
                lb.delivered.append(split_ref(value)[1])
                lb.pending -= 1
                self._attempts.pop(value, None)
                self.lateness.observe(max(0, now - due_ms) / 1000)
                stored.add(record.subject)
            elif error[0] in RETRIABLE_SEND_CODES:
                unreachable.setdefault(record.subject, []).append(value)
                why.setdefault(record.subject, error[1])
            else:
                refused.append((value, error[1]))
        released = False
        for subject in stored:
            if (count := self.parking.release(subject, now)) is not None:  # its brokers take messages again
                if count:  # none: only its probes were out
                    log.info("a broker takes %s again: %d waiting messages released", subject, count)
                released = True
        for subject, values in unreachable.items():
            if subject in stored:  # others of it went: these failed on their own
                refused.extend((value, "not stored") for value in values)
                continue
            streak = self.parking.park(subject, values, now, sent_ms)
            if streak is not None:  # newly parked; parked again soon after its release: quieter
                (log.warning if streak == 0 else log.info)(
                    "no broker takes %s now; its messages wait for it, probed: %s", subject, why[subject]
                )
        for n, (value, error) in enumerate(refused):
            attempts = self._attempts[value] = self._attempts.get(value, 0) + 1
            backoff = RETRY_BACKOFF_S[min(attempts, len(RETRY_BACKOFF_S)) - 1]
            self.wheel.add(tick_of(now + int(backoff * 1000)), value)
            if n == 0:
                log.warning("delivery failed, retrying with backoff (%g s for the first): %s", backoff, error)
        failed = sum(e is not None for e in errors)
        self.counters["fired"] += len(items) - failed
        self.counters["failures"] += failed
        self._flush_delivered(touched)
        if failed or released:
            self._wake.set()
        for lb in touched:
            self._check_done(lb)

    def _flush_delivered(self, buckets: Iterable[LoadedBucket] | None = None) -> None:
        for lb in buckets if buckets is not None else self.loaded.values():
            if lb.delivered:
                lb.dispatch.append(lb.delivered)
                self.on_dispatched(lb.start_ms, lb.delivered)
                lb.delivered = []

    # ---- the clock ----------------------------------------------------------------------------

    async def _clock_loop(self) -> None:
        while True:
            await asyncio.sleep(CLOCK_POLL_S)
            if self.clock.refresh():
                self._wake.set()
                self._loader_wake.set()

    # ---- durability and figures -----------------------------------------------------------------

    def take_dirty(self) -> list[Path]:
        """Dispatch logs written since the last call, for the checkpoint to fsync."""
        return [path for lb in self.loaded.values() for path in lb.dispatch.take_dirty()]

    def pending_by_bucket(self) -> dict[str, int]:
        """Messages not yet delivered per bucket: exact for loaded buckets; for the others, and for
        one still loading (its count is not known until it is read), the messages scheduled in them
        (cancelled ones included)."""
        out = {}
        for start in sorted(self.schedule.starts):
            if start in self.done:
                continue
            lb = self.loaded.get(start)
            if lb is not None and not lb.loading:
                out[lb.name] = lb.pending
            else:
                name = bucket_name(start)
                try:
                    out[name] = os.stat(self.schedule.directory / (name + INDEX_SUFFIX)).st_size // INDEX_SIZE
                except FileNotFoundError:
                    continue
        return out

    def stats(self) -> dict[str, Any]:
        buckets = self.pending_by_bucket()
        return {
            "now_ms": self.clock.now_ms(),
            "clock_offset_ms": self.clock.offset_ms,
            "bucket_minutes": self.schedule.bucket_minutes,
            "pending": sum(buckets.values()),
            "buckets": buckets,
            "loaded": sorted(lb.name for lb in self.loaded.values() if not lb.loading),
            "wheel": len(self.wheel),
            "wheel_bytes": self.wheel.nbytes(),
            "held": self.held,  # due, read from disk, not yet delivered
            "max_held": self.max_held,
            "held_peak": self.held_peak,
            "due_waiting": self.due_waiting(),
            "parked": len(self.parking),  # waiting for a broker of their subject (parking.py)
            "releasing": self.parking.releasing_count,  # released, going back to the wheel tick by tick
            "parked_subjects": self.parking.stats(),  # the subjects with the most, and how many
            "cancels_kept": len(self.cancels),
            **self.counters,
            "lateness": {
                "count": self.lateness.count,
                "sum_s": self.lateness.total,
                "counts": list(self.lateness.counts),
            },
        }


def release_free_memory() -> None:
    """Hand memory freed after a large transient job (recovery, loading a bucket) back to the system:
    glibc keeps freed heap, thread arenas above all, which would count against the wheel's budget."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _read_bucket(lb: LoadedBucket, count: int) -> tuple[dict[int, array], int, int]:
    """(values by tick, how many, how many left out as delivered) for the first `count` entries of a
    bucket. Runs in a thread: only reads files, and builds arrays nobody else sees yet."""
    delivered = lb.dispatch.delivered()
    ticks: dict[int, array] = {}
    pending = 0
    slot_bits = ref(lb.slot, 0)
    for _offset, position, due_ms in lb.reader.iter_due(count):
        if position in delivered:
            continue
        tick = due_ms // TICK_MS
        values = ticks.get(tick)
        if values is None:
            ticks[tick] = values = array("q")
        values.append(slot_bits | position)
        pending += 1
    return ticks, pending, len(delivered)
