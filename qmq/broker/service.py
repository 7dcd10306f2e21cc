"""The broker's request handler: send, pull (long polling), ack, nack, heartbeat and administration,
over a `LogStore` and the consumption `BrokerState` (docs/broker.md).

Everything runs on the event loop thread: the store's appends and reads go to the page cache and are
short, while fsyncs happen in the store's flusher thread. Each request applies its changes to the
state, journals them in one record and, before replying, awaits durability of everything it wrote
(a no-op wait in async flush mode). Background tasks fire due retries, give the messages of silent
consumers back to their group, and snapshot the state.

Promises: a send is acknowledged only once durable (sync mode); a pull never hands out a message to
two consumers of a group while both are alive; nothing pulled is lost by a crash (it is resent until
acked); a failing message goes to its group's retry subject after the delay asked for, or to the
dead-letter subject, without holding up the rest of its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from qmq.broker import journal, metrics, snapshot
from qmq.broker.consumer_group import ConsumerGroup, Reset, UnknownConsumer
from qmq.broker.journal import Create, Entry, Fired, GroupAction, Redriven, Schedule
from qmq.broker.state import BrokerState
from qmq.broker.system_subjects import dead_subject, delivery, retry_subject, unwrap, user_subject, wrap
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.limits import (
    ACTION_SUBJECT,
    DEFAULT_LIMITS,
    GROUP_RE,
    Limits,
    validate_sent_message,
    validate_subject,
    validate_tags,
)
from qmq.store import record as rec
from qmq.store.flush import FlushFailed
from qmq.store.store import LogStore, Message, StoreError

log = logging.getLogger("qmq.broker")

DEFAULT_CONSUMER_TIMEOUT_S = 60.0  # a consumer silent this long loses its unacked messages to its group
DEFAULT_MAX_ATTEMPTS = 32  # then a message goes to the dead-letter subject
DEFAULT_PULL_MAX = 64
MAX_PULL = 4096  # messages in one pull reply
DEFAULT_WAIT_MS = 2500  # long polling
MAX_WAIT_MS = 30_000
SNAPSHOT_INTERVAL_S = 10.0
RETRY_FIRE_BATCH = 1024  # due retries appended per round
RETRY_BACKOFF_S = 1.0  # after a round that could not append (store failure)
MAX_GROUP_KEY_LEN = 64
CONSUMER_RE = re.compile(r"[A-Za-z0-9._\-:@]{1,200}")
REPLAY_BATCH = 256  # journal records read per step at start

Clock = Callable[[], float]


def _bad(message: str, *, fatal: bool = False) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message, fatal=fatal)


def _unknown(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.UNKNOWN_CONSUMER, message, fatal=True)


def _get(body: dict[str, Any], name: str, type_: type | tuple[type, ...], default: Any = ...) -> Any:
    value = body.get(name, default)
    if value is ...:
        raise _bad(f"missing field {name!r}")
    if value is not default and (not isinstance(value, type_) or (type_ is int and isinstance(value, bool))):
        raise _bad(f"field {name!r} has type {type(value).__name__}")
    return value


def _int(body: dict[str, Any], name: str, default: int, low: int, high: int) -> int:
    value = _get(body, name, int, default)
    if not low <= value <= high:
        raise _bad(f"field {name!r} must be {low}-{high}, got {value}")
    return value


def _group(value: Any) -> str:
    if not isinstance(value, str) or not GROUP_RE.fullmatch(value) or len(value) > MAX_GROUP_KEY_LEN:
        raise _bad(
            f"group {value!r} must be 1-{MAX_GROUP_KEY_LEN} letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def _consumer(value: Any) -> str:
    if not isinstance(value, str) or not CONSUMER_RE.fullmatch(value):
        raise _bad(f"consumer {value!r} must be 1-200 letters, digits, '.', '_', '-', ':' or '@'")
    return value


def broadcast_key(group: str, consumer: str) -> str:
    """A broadcast consumer's own group key: short, so retry subjects stay valid names."""
    return f"{group}.bc-{hashlib.sha1(consumer.encode()).hexdigest()[:12]}"


class BrokerService:
    def __init__(
        self,
        store: LogStore,
        *,
        group_name: str = "",
        state_dir: Path | None = None,
        consumer_timeout_s: float = DEFAULT_CONSUMER_TIMEOUT_S,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        limits: Limits = DEFAULT_LIMITS,
        clock: Clock = time.time,
    ) -> None:
        self.store = store
        self.group_name = group_name
        self.state_dir = state_dir or store.data_dir / "consumers"
        self.consumer_timeout_s = consumer_timeout_s
        self.max_attempts = max_attempts
        self.limits = limits
        self.clock = clock
        self.read_only = False
        self.state = self._recover()
        self._valid_subjects: set[str] = set()
        self._waiters: dict[str, set[asyncio.Future[None]]] = defaultdict(set)
        self._retry_wakeup: asyncio.Event | None = None
        self._sends: list[tuple[list[Message], asyncio.Future[None]]] = []  # waiting for _store_sends
        self._settling: set[asyncio.Task[None]] = set()  # sends appended, waiting to be durable
        self._tasks: list[asyncio.Task[None]] = []
        self._handlers = {
            RequestCode.PING: self._ping,
            RequestCode.BROKER_SEND: self._send,
            RequestCode.BROKER_PULL: self._pull,
            RequestCode.BROKER_ACK: self._ack,
            RequestCode.BROKER_NACK: self._nack,
            RequestCode.BROKER_HEARTBEAT: self._heartbeat,
            RequestCode.BROKER_RESET: self._reset,
            RequestCode.BROKER_DEAD_LIST: self._dead_list,
            RequestCode.BROKER_DEAD_REDRIVE: self._redrive,
            RequestCode.BROKER_STATS: self._stats,
        }

    # ---- start, background work, stop ---------------------------------------------------------

    def _recover(self) -> BrokerState:
        now = self.clock()
        saved = snapshot.load(self.state_dir)
        state = BrokerState.from_snapshot(saved, now) if saved else BrokerState()
        first = self.store.first_seq(ACTION_SUBJECT)
        if state.journal_seq < first:
            log.error(
                "the journal before sequence %d was removed by retention but the snapshot covers only "
                "up to %d: consumer positions may go back",
                first,
                state.journal_seq,
            )
        seq, replayed = state.journal_seq, 0
        while True:
            result = self.store.read(ACTION_SUBJECT, seq, REPLAY_BATCH)
            for record in result.records:
                for entry in journal.decode(record.payload):
                    state.apply(entry, now)
                    replayed += 1
            if result.next_seq == seq:
                break
            seq = result.next_seq
        state.journal_seq = seq
        log.info(
            "consumption state: %d groups, %d pending retries, %d journal entries replayed",
            len(state.groups),
            len(state.retries),
            replayed,
        )
        return state

    def start(self) -> None:
        """Start the background tasks on the running loop."""
        self._retry_wakeup = asyncio.Event()
        for coro in (self._retry_loop(), self._sweep_loop(), self._snapshot_loop()):
            self._tasks.append(asyncio.create_task(coro))

    async def close(self) -> None:
        """Stop the background tasks and write a last snapshot."""
        await self.stop_background()
        await self.take_snapshot()

    async def stop_background(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()

    async def take_snapshot(self) -> None:
        data = self.state.to_snapshot()
        await self.store.flusher.durable(self.store.message_log.end_offset)
        await asyncio.to_thread(snapshot.save, self.state_dir, data)

    async def _snapshot_loop(self) -> None:
        saved_at = self.state.journal_seq
        while True:
            await asyncio.sleep(SNAPSHOT_INTERVAL_S)
            if self.state.journal_seq != saved_at:
                saved_at = self.state.journal_seq
                try:
                    await self.take_snapshot()
                except Exception:
                    log.exception("snapshot failed; the journal still has everything")

    async def _retry_loop(self) -> None:
        assert self._retry_wakeup is not None
        while True:
            next_due = self.state.retries.next_due()
            timeout = None if next_due is None else max(0.0, next_due / 1000 - self.clock())
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._retry_wakeup.wait()
            self._retry_wakeup.clear()
            try:
                while self._fire_due():
                    await asyncio.sleep(0)
            except StoreError as exc:
                log.error("cannot append due retries, trying again in %g s: %s", RETRY_BACKOFF_S, exc)
                await asyncio.sleep(RETRY_BACKOFF_S)

    def _fire_due(self) -> int:
        """Append due retries to their retry subjects; how many were due."""
        due = self.state.retries.take_due(int(self.clock() * 1000), RETRY_FIRE_BATCH)
        if not due:
            return 0
        messages, woken = [], set()
        for entry in due:
            record = self._record_at(entry.offset)
            if record is None:
                log.warning(
                    "retry %d of %s: its message was removed by retention before it came due",
                    entry.id,
                    entry.retry_subject,
                )
                continue
            message = wrap(record, entry.retry_subject, entry.attempt, entry.reason)
            messages.append(message)
            woken.add(unwrap(record).subject)
        try:
            if messages:
                self.store.append(messages)
        except StoreError:
            self.state.retries.put_back(due)
            raise
        self._apply_and_commit([Fired(tuple(e.id for e in due))])
        self._wake(woken)
        return len(due)

    async def _sweep_loop(self) -> None:
        interval = min(5.0, self.consumer_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                self.sweep()
            except StoreError as exc:
                log.error("cannot release silent consumers' messages now: %s", exc)
            metrics.update(self)

    def sweep(self) -> int:
        """Give the unacked messages of consumers silent for the timeout back to their group, through
        the retry subject (due at once, one attempt more); how many were moved."""
        moved = 0
        for group in list(self.state.groups.values()):
            for release, seqs in group.silent(self.clock(), self.consumer_timeout_s):
                messages = []
                for record in self._records(group.subject, seqs):
                    original = unwrap(record)
                    attempt = original.attempt + 1
                    reason = f"consumer {release.consumer} went silent"
                    to = (dead_subject if attempt > self.max_attempts else retry_subject)(original.subject, group.group)
                    messages.append(wrap(record, to, attempt, reason))
                if messages:
                    self.store.append(messages)
                self._apply_and_commit([GroupAction(group.subject, group.group, release)])
                log.warning(
                    "consumer %s of group %s on %s silent for %g s: %d unacked messages go back to the group",
                    release.consumer,
                    group.group,
                    group.subject,
                    self.consumer_timeout_s,
                    len(messages),
                )
                self._wake({user_subject(group.subject)})
                moved += len(messages)
        return moved

    # ---- the journal and wake-ups ---------------------------------------------------------------

    def _commit(self, entries: list[Entry]) -> int:
        """Journal `entries`, already applied; the log offset whose durability covers them."""
        appended = self.store.append([Message(ACTION_SUBJECT, f"%a{self.state.journal_seq}", journal.encode(entries))])
        self.state.journal_seq = appended[0].seq + 1
        return appended[0].end

    def _apply_and_commit(self, entries: list[Entry]) -> int:
        now = self.clock()
        for entry in entries:
            self.state.apply(entry, now)
        return self._commit(entries)

    def _wake(self, subjects: Iterable[str]) -> None:
        for subject in subjects:
            for future in self._waiters.pop(subject, ()):
                if not future.done():
                    future.set_result(None)

    # ---- requests -------------------------------------------------------------------------------

    async def handle(self, request: Request, peer: PeerInfo) -> dict[str, Any] | None:
        handler = self._handlers.get(request.code)
        name = _request_name(request.code)
        metrics.HOT.requests[name] += 1
        try:
            if handler is None:
                raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"the broker has no request code {request.code}")
            body = request.body if request.body is not None else {}
            if not isinstance(body, dict):
                raise ProtocolError(ErrorCode.BAD_BODY, "the body must be a map", fatal=False)
            try:
                return await handler(body, peer)
            except (StoreError, FlushFailed) as exc:  # one place for every request that writes
                log.error("request %s from %s: the store cannot take it: %s", name, peer, exc)
                raise RemoteError(ErrorCode.UNAVAILABLE, f"the broker's store cannot take this now: {exc}") from None
        except (ProtocolError, RemoteError) as exc:
            metrics.ERRORS.labels(
                name, ErrorCode(exc.code).name if exc.code in ErrorCode._value2member_map_ else str(exc.code)
            ).inc()
            if isinstance(exc, ProtocolError) and exc.fatal:
                log.warning("%s: %s", peer, exc)
            raise

    async def _ping(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        return body

    async def _send(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        messages = _get(body, "messages", list)
        if self.read_only:
            raise RemoteError(ErrorCode.READ_ONLY, f"broker group {self.group_name} is read-only: send elsewhere")
        batch: list[Message] = []
        rejected: list[list[Any]] = []
        for index, item in enumerate(messages):
            try:
                batch.append(self._message(item))
            except ProtocolError as exc:
                rejected.append([index, int(exc.code), exc.message])
        if batch:
            await self._store_soon(batch)
            subjects = [batch[0].subject] if len(batch) == 1 else Counter(m.subject for m in batch)
            if len(batch) == 1:
                metrics.HOT.stored[batch[0].subject] += 1
            else:
                metrics.HOT.stored.update(subjects)
        return {"stored": len(batch), "rejected": rejected}

    def _store_soon(self, batch: list[Message]) -> asyncio.Future[None]:
        """Store `batch` together with every other send of this loop iteration, and resolve once all of
        them are durable: many small requests in flight cost one store append (one write per log) and
        one durability wait, instead of one each."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self._sends:
            loop.call_soon(self._store_sends)
        self._sends.append((batch, future))
        return future

    def _store_sends(self) -> None:
        sends, self._sends = self._sends, []
        try:
            appended = self.store.append([m for batch, _ in sends for m in batch])
        except StoreError as exc:
            for _, future in sends:
                future.set_exception(RemoteError(ErrorCode.UNAVAILABLE, f"the broker cannot store messages: {exc}"))
            return
        # Waiting pulls are woken now, not once the messages are durable: a pull's reply waits for its
        # own journal entry, which follows these messages in the same log, so one fsync covers both.
        self._wake({m.subject for batch, _ in sends for m in batch})
        task = asyncio.get_running_loop().create_task(self._settle_sends([f for _, f in sends], appended[-1].end))
        self._settling.add(task)
        task.add_done_callback(self._settling.discard)

    async def _settle_sends(self, futures: list[asyncio.Future[None]], end: int) -> None:
        try:
            await self.store.durable(end)
        except Exception as exc:
            error = RemoteError(ErrorCode.UNAVAILABLE, f"the broker could not make messages durable: {exc}")
            for future in futures:
                if not future.done():
                    future.set_exception(error)
            return
        for future in futures:
            if not future.done():
                future.set_result(None)

    def _message(self, item: Any) -> Message:
        m = validate_sent_message(item, self.limits, self._valid_subjects)
        return Message(m.subject, m.id, m.payload, m.key, m.tags)

    async def _pull(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        subject = validate_subject(_get(body, "subject", str), limits=self.limits)
        group = _group(body.get("group"))
        consumer = _consumer(body.get("consumer"))
        max_count = _int(body, "max", DEFAULT_PULL_MAX, 1, MAX_PULL)
        wait_ms = _int(body, "wait_ms", DEFAULT_WAIT_MS, 0, MAX_WAIT_MS)
        tags = validate_tags(_get(body, "tags", list, []))
        match_all = bool(body.get("match_all", False))
        broadcast = bool(body.get("broadcast", False))
        start = _get(body, "start", str, "latest")
        if start not in ("latest", "earliest"):
            raise _bad(f"start must be 'latest' or 'earliest', got {start!r}")
        pulled = _get(body, "pulled", dict, {})
        for stored, last in pulled.items():
            if not isinstance(stored, str) or not isinstance(last, int) or isinstance(last, bool):
                raise _bad(f"pulled must map stored subjects to pull sequences, got {stored!r}: {last!r}")
        key = broadcast_key(group, consumer) if broadcast else group
        if len(retry_subject(subject, key)) > self.limits.max_subject_len:
            raise _bad(
                f"subject {subject!r} and group {key!r} together are too long for the retry subject "
                f"(at most {self.limits.max_subject_len} characters)"
            )
        deadline = asyncio.get_running_loop().time() + wait_ms / 1000
        while True:
            batches, end = self._take(subject, key, consumer, max_count, tags, match_all, broadcast, start, pulled)
            if end is not None:
                await self.store.durable(end)
            if batches:
                return {"batches": batches}
            remaining = deadline - asyncio.get_running_loop().time()
            if remaining <= 0:
                return {"batches": []}
            future = asyncio.get_running_loop().create_future()
            self._waiters[subject].add(future)
            try:
                async with asyncio.timeout(remaining):
                    await future
            except TimeoutError:
                return {"batches": []}
            finally:
                self._waiters.get(subject, set()).discard(future)

    def _take(
        self,
        subject: str,
        key: str,
        consumer: str,
        max_count: int,
        tags: tuple[str, ...],
        match_all: bool,
        broadcast: bool,
        start: str,
        pulled: dict,
    ) -> tuple[list[dict], int | None]:
        """Hand `consumer` the next messages: due retries first, then the subject. Returns the batches
        and the log offset to await before replying (None when nothing was journalled). Whatever was
        applied is journalled, even when a read fails half-way."""
        entries: list[Entry] = []
        batches: list[dict] = []
        try:
            self._take_into(
                entries, batches, subject, key, consumer, max_count, tags, match_all, broadcast, start, pulled
            )
        finally:
            end = self._commit(entries) if entries else None
        return batches, end

    def _take_into(
        self,
        entries: list[Entry],
        batches: list[dict],
        subject: str,
        key: str,
        consumer: str,
        max_count: int,
        tags: tuple[str, ...],
        match_all: bool,
        broadcast: bool,
        start: str,
        pulled: dict,
    ) -> None:
        now = self.clock()
        remaining = max_count
        retry = retry_subject(subject, key)
        for stored in (retry, subject):
            group = self.state.group(stored, key)
            if group is None:
                if stored == retry and not self.store.next_seq(retry):
                    continue
                cursor = (
                    0
                    if stored == retry
                    else (self.store.first_seq(subject) if start == "earliest" else self.store.next_seq(subject))
                )
                create = Create(stored, key, cursor, broadcast)
                self.state.apply(create, now)
                entries.append(create)
                group = self.state.groups[(stored, key)]
            if remaining <= 0:
                break
            fresh: dict[int, rec.Record] = {}

            def read(cursor: int, count: int, stored: str = stored, fresh: dict = fresh) -> tuple[list[int], int]:
                result = self.store.read(stored, cursor, count, tags=tags, match_all=match_all)
                for record in result.records:
                    fresh[record.seq] = record
                return [r.seq for r in result.records], result.next_seq

            handed, action = group.pull(consumer, pulled.get(stored, -1), remaining, read, now)
            if action is not None:
                entries.append(GroupAction(stored, key, action))
            if handed.seqs:
                records = [fresh[s] for s in handed.seqs] if not handed.resent else self._records(stored, handed.seqs)
                batches.append(
                    {
                        "subject": stored,
                        "group": key,
                        "first_pull": handed.first_pull,
                        "resent": handed.resent,
                        "messages": [delivery(r) for r in records],
                    }
                )
                remaining -= len(handed.seqs)

    def _records(self, stored: str, seqs: list[int]) -> list[rec.Record]:
        """The records of consume-log sequences `seqs` of `stored`, skipping any removed by retention."""
        spans = []
        for seq in seqs:
            entries = self.store.entries(stored, seq, 1)
            if entries and entries[0] is not None and entries[0].offset >= self.store.message_log.start_offset:
                spans.append((entries[0].offset, entries[0].size))
        return [r for r in self.store.message_log.read_records(spans) if not r.is_blank]

    def _record_at(self, offset: int) -> rec.Record | None:
        if offset < self.store.message_log.start_offset:
            return None
        return self.store.read_record(offset)

    def _known_group(self, stored: Any, key: Any) -> ConsumerGroup:
        group = self.state.group(stored, key) if isinstance(stored, str) and isinstance(key, str) else None
        if group is None:
            raise _unknown(f"group {key!r} never pulled {stored!r} from this broker")
        return group

    async def _ack(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        entries: list[Entry] = []
        now = self.clock()
        acks = _get(body, "acks", list)
        error: ProtocolError | None = None
        for item in acks:  # all checked before any is applied
            if (
                not isinstance(item, list | tuple)
                or len(item) != 4
                or not isinstance(item[3], int)
                or isinstance(item[3], bool)
            ):
                raise _bad("each ack must be [subject, group, consumer, last_pull]")
            _consumer(item[2])
            self._known_group(item[0], item[1])
        for stored, key, consumer, last_pull in acks:
            group = self._known_group(stored, key)
            try:
                action = group.ack(consumer, last_pull, now)
            except UnknownConsumer as exc:
                error = _unknown(str(exc))
                break
            except ValueError as exc:
                error = _unknown(f"consumer {consumer!r} of group {key!r} on {stored!r}: {exc}")
                break
            if action is not None:
                entries.append(GroupAction(stored, key, action))
        if entries:  # the acks before a bad one are applied: journal them too
            end = self._commit(entries)
            if error is not None:
                raise error
            await self.store.durable(end)
        elif error is not None:
            raise error
        return {}

    async def _nack(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        outcomes: list[list[Any]] = []
        entries: list[Entry] = []
        dead: list[Message] = []
        now = self.clock()
        for item in _get(body, "nacks", list):
            if not isinstance(item, dict):
                raise _bad("each nack must be a map")
            stored, key = item.get("subject"), item.get("group")
            consumer = _consumer(item.get("consumer"))
            group = self._known_group(stored, key)
            pull_seq = _get(item, "pull_seq", int)
            attempt = _get(item, "attempt", int, 1)
            delay_ms = _int(item, "delay_ms", 0, 0, 10 * 365 * 86400 * 1000)
            max_attempts = _int(item, "max_attempts", self.max_attempts, 1, 1_000_000)
            reason = str(item.get("reason") or "")[:1000]
            state = group.consumers.get(consumer)
            if state is None:
                raise _unknown(f"consumer {consumer!r} never pulled {stored!r} as group {key!r}")
            if pull_seq < state.pull_log.ack_seq:
                outcomes.append(["acked", None])  # already done: nothing to retry
                continue
            try:
                seq = state.pull_log.lookup(pull_seq, pull_seq)[0]
            except KeyError as exc:
                raise _unknown(f"consumer {consumer!r}: {exc}") from None
            state.last_seen = now
            records = self._records(stored, [seq])
            if not records:
                outcomes.append(["gone", None])  # removed by retention
                continue
            record = records[0]
            original = unwrap(record)
            attempt = max(attempt, original.attempt)
            if item.get("dead") or attempt >= max_attempts:
                why = reason or f"failed {attempt} attempts"
                dead.append(wrap(record, dead_subject(original.subject, key), attempt, why))
                outcomes.append(["dead", None])
            else:
                due_ms = int(now * 1000) + delay_ms
                entries.append(
                    Schedule(
                        self.state.retries.next_id + len(entries),
                        due_ms,
                        record.offset,
                        attempt + 1,
                        retry_subject(original.subject, key),
                        reason,
                    )
                )
                outcomes.append(["retry", due_ms])
        end = 0
        if dead:
            appended = self.store.append(dead)
            end = appended[-1].end
            for outcome, message in zip((o for o in outcomes if o[0] == "dead"), appended, strict=True):
                outcome[1] = message.seq
            log.info("%d messages dead-lettered", len(dead))
        if entries:
            end = self._apply_and_commit(entries)
            assert self._retry_wakeup is not None
            self._retry_wakeup.set()
        if end:
            await self.store.durable(end)
        return {"outcomes": outcomes}

    async def _heartbeat(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        now = self.clock()
        for item in _get(body, "consumers", list):
            if not (isinstance(item, list | tuple) and len(item) == 3 and all(isinstance(x, str) for x in item)):
                raise _bad("each heartbeat must be [subject, group, consumer]")
            group = self.state.group(item[0], item[1])
            if group is not None:
                group.heartbeat(item[2], now)
        return {}

    def _admin_target(self, body: dict[str, Any]) -> tuple[str, str]:
        return validate_subject(_get(body, "subject", str), limits=self.limits), _group(body.get("group"))

    async def _reset(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        subject, group = self._admin_target(body)
        to = body.get("to", "latest")
        if to == "earliest":
            cursor = self.store.first_seq(subject)
        elif to == "latest":
            cursor = self.store.next_seq(subject)
        elif isinstance(to, int) and not isinstance(to, bool) and to >= 0:
            cursor = min(max(to, self.store.first_seq(subject)), self.store.next_seq(subject))
        else:
            raise _bad(f"'to' must be 'earliest', 'latest' or a sequence number, got {to!r}")
        entries: list[Entry] = []
        if self.state.group(subject, group) is None:
            entries.append(Create(subject, group, cursor, False))
        else:
            entries.append(GroupAction(subject, group, Reset(cursor)))
        await self.store.durable(self._apply_and_commit(entries))
        log.info("group %s on %s reset to %d", group, subject, cursor)
        return {"cursor": cursor}

    async def _dead_list(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        subject, group = self._admin_target(body)
        dead = dead_subject(subject, group)
        start = _get(body, "from", int, self.state.redriven.get(dead, 0))
        max_count = _int(body, "max", 100, 1, MAX_PULL)
        result = self.store.read(dead, start, max_count)
        messages = []
        for record in result.records:
            item = delivery(record)
            item["seq"] = record.seq
            item["reason"] = unwrap(record).reason
            messages.append(item)
        return {"messages": messages, "next": result.next_seq}

    async def _redrive(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        subject, group = self._admin_target(body)
        dead = dead_subject(subject, group)
        seq, end, count, last = self.state.redriven.get(dead, 0), self.store.next_seq(dead), 0, 0
        while seq < end:
            result = self.store.read(dead, seq, 256)
            if result.records:
                appended = self.store.append(
                    [wrap(r, retry_subject(subject, group), 1, "re-driven") for r in result.records]
                )
                last = appended[-1].end
                count += len(result.records)
            if result.next_seq == seq:
                break
            seq = result.next_seq
        if seq > self.state.redriven.get(dead, 0):
            last = self._apply_and_commit([Redriven(dead, seq)])
        if last:
            await self.store.durable(last)
        self._wake({subject})
        log.info("%d dead letters of group %s on %s re-driven", count, group, subject)
        return {"redriven": count}

    async def _stats(self, body: dict[str, Any], peer: PeerInfo) -> dict[str, Any]:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Per subject: stored; per (subject, group): backlog, in flight, retrying, dead, consumers."""
        subjects = self.store.subjects()
        groups = []
        for (stored, key), group in self.state.groups.items():
            if stored.startswith("%"):
                continue
            retry = retry_subject(stored, key)
            retry_group = self.state.group(retry, key)
            retry_end = subjects.get(retry, 0)
            retry_backlog = retry_group.backlog(retry_end) if retry_group else retry_end
            dead = dead_subject(stored, key)
            groups.append(
                {
                    "subject": stored,
                    "group": key,
                    "backlog": group.backlog(subjects.get(stored, 0)) + retry_backlog,
                    "in_flight": group.in_flight() + (retry_group.in_flight() if retry_group else 0),
                    "retrying": self.state.retries.pending_for(retry) + retry_backlog,
                    "dead": subjects.get(dead, 0) - self.state.redriven.get(dead, 0),
                    "consumers": len(group.consumers),
                }
            )
        return {
            "group": self.group_name,
            "read_only": self.read_only,
            "subjects": {s: {"stored": n} for s, n in subjects.items() if not s.startswith("%")},
            "groups": groups,
        }


@functools.cache
def _request_name(code: int) -> str:
    try:
        return RequestCode(code).name.lower()
    except ValueError:
        return "unknown"
