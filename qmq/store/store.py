"""The log store: the storage engine of the broker and the delay server.

One message log holds every record; per-subject consume logs and a key index are derived from it; a
checkpoint says how far the derived logs are complete, so a restart replays only what follows it.
Appends are thread-safe and batched; durability is awaited separately (see `flush.py`), so a server
can keep appending while earlier batches wait for their fsync.

Layout of a data directory (docs/formats.md):
    messagelog/<base offset>           consumelog/<subject>/<base seq>
    index/<base offset>                checkpoint/checkpoint.json
    quarantine/ (only after a repair)  LOCK
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import NamedTuple

from qmq.protocol.errors import ProtocolError
from qmq.protocol.limits import MAX_KEY_LEN, MAX_MESSAGE_ID_LEN, validate_subject, validate_tags
from qmq.store import checkpoint as ckpt
from qmq.store import checksum, speedups
from qmq.store import record as rec
from qmq.store.consume_log import (
    DEFAULT_ENTRIES_PER_SEGMENT,
    ENTRY_SIZE,
    ConsumeLog,
    DamagedEntry,
    Entry,
    pack_entry,
)
from qmq.store.cross_check import checkpoint_problem
from qmq.store.damage import Damage, DamagedRegion
from qmq.store.disk_space import PROBE_INTERVAL_S, is_out_of_space, space_available
from qmq.store.files import fsync_dir, pwrite_all, read_json, write_json
from qmq.store.flush import DEFAULT_ASYNC_INTERVAL_MS, DEFAULT_COMMIT_WINDOW_MS, FlushFailed, FlushMode
from qmq.store.index import DEFAULT_CAPACITY, DEFAULT_SLOTS, KeyIndex
from qmq.store.message_log import DEFAULT_SEGMENT_BYTES, MessageLog
from qmq.store.native_flush import new_flusher
from qmq.store.rebuild import rebuild_consume_log, rebuild_index
from qmq.store.recovery import RecoveryReport, replay, scan_for_recovery
from qmq.store.recovery_point import RecoveryPoint
from qmq.store.replication import ChunkError, check_chunk, first_record_size, split_chunk, whole_prefix
from qmq.store.scrub import Scrub

log = logging.getLogger("qmq.store")

FORMAT_FILE = "store.json"
FORMAT_VERSION = 1
DEFAULT_CHECKPOINT_INTERVAL_S = 10.0
DEFAULT_CHECKPOINT_BYTES = 256 * 1024 * 1024
BACKGROUND_TICK_S = 0.5
DEFAULT_RETENTION_S = 72 * 3600
DEFAULT_CLEAN_INTERVAL_S = 60.0
SEARCH_BATCH = 64  # consume-log entries read at a time when looking for those pointing at an offset
_BLANK = int(rec.Attr.BLANK)  # compared per record read
_new_tuple = tuple.__new__  # a named tuple's own __new__ is a Python function: too slow per message
VERIFY_RECENT_SEGMENTS = 3  # the active segment and the two sealed before it are CRC-checked at every open


class StoreError(Exception):
    """A request the store cannot take (bad argument, store closed or read-only)."""


@dataclass(frozen=True)
class StoreConfig:
    segment_bytes: int = DEFAULT_SEGMENT_BYTES
    consume_segment_entries: int = DEFAULT_ENTRIES_PER_SEGMENT
    index_slots: int = DEFAULT_SLOTS
    index_capacity: int = DEFAULT_CAPACITY
    flush: FlushMode = FlushMode.SYNC
    flush_interval_ms: int = DEFAULT_ASYNC_INTERVAL_MS  # async mode
    commit_window_ms: float = DEFAULT_COMMIT_WINDOW_MS  # sync mode, under load (flush.py)
    checkpoint_interval_s: float = DEFAULT_CHECKPOINT_INTERVAL_S
    checkpoint_bytes: int = DEFAULT_CHECKPOINT_BYTES  # or after this much was appended
    retention_s: float = DEFAULT_RETENTION_S
    clean_interval_s: float = DEFAULT_CLEAN_INTERVAL_S
    verify_all_on_open: bool = False  # CRC-check every segment at open, not only the recent ones
    scrub: bool = True  # CRC-check the rest in the background after open (scrub.py), if `background`
    repair: bool = False  # quarantine corrupt regions instead of refusing to open
    background: bool = True  # run the checkpoint and cleaner thread


class Message(NamedTuple):
    """What a producer hands the store. `payload` is opaque to the store."""

    subject: str
    message_id: str
    payload: bytes
    key: str | None = None
    tags: tuple[str, ...] = ()
    flags: int = 0


class Appended(NamedTuple):
    offset: int
    seq: int
    end: int  # durability of this record is `end <= durable offset`


@dataclass
class ReadResult:
    records: list[rec.Record]
    next_seq: int  # where the next read of this subject should start


class LogStore:
    """Open with `LogStore(data_dir, config)`; close with `close()` (or use as a context manager).

    What servers use, and all they use: `append` (with `GroupCommit` in group_commit.py on an event
    loop), `durable` / `flushed` / `durable_offset`; per subject `read`, `records`, `entries`,
    `next_seq`, `first_seq`, `subjects`; by id or key `find_by_id`, `find_by_key`; the message log as
    such `start_offset`, `end_offset`, `read_bytes`, `scan`, `read_record`. `message_log`, `flusher`
    and `index` are the store's own parts (its tests look at them)."""

    def __init__(self, data_dir: str | os.PathLike, config: StoreConfig | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_directory(self.data_dir)
        try:
            self.config = _fixed_format(self.data_dir, config or StoreConfig())
            self.message_log = MessageLog(self.data_dir / "messagelog", self.config.segment_bytes)
        except BaseException:
            os.close(self._lock_fd)
            raise
        self._lock = threading.RLock()
        self._closed = False
        self._consume_dir = self.data_dir / "consumelog"
        self._checkpoint_dir = self.data_dir / "checkpoint"
        self._next_seq: dict[str, int] = {}
        self._subject_bytes: dict[str, bytes] = {}
        self._subject_names: dict[bytes, str] = {}  # subjects met in replicated chunks
        self._consume_logs: dict[str, ConsumeLog] = {}
        self._failed: BaseException | None = None  # a write failure that only a reopen clears
        self._failed_reason: str | None = None
        self._out_of_space: str | None = None  # why, while the disk is full (cleared by a probe)
        self._out_of_space_since = 0.0
        self.unreadable: dict[tuple[str, int], str] = {}  # (subject, seq) -> where and why, found by reads
        self.damaged: list[tuple[str, int, str]] = []  # (segment file, offset, reason) found by the scrub
        self.damage = Damage()  # the damaged regions, awaiting a mend from a group member or lost (damage.py)
        self._rebuilds = 0  # derived files rebuilt while open (metrics, tests)
        self._index_rebuilt_at = -1
        # Test hook (documented in docs/operating.md): called with what is about to be written; an
        # OSError it raises is handled exactly as the write's own would be.
        self.write_hook: Callable[[str], None] | None = None
        self._checkpointed = threading.Condition()
        self.checkpoint_offset = 0  # of the last checkpoint written
        self.index: KeyIndex | None = None
        self.append_listeners: list[Callable[[int], None]] = []  # called with the new end after appends
        self._recovery_point = RecoveryPoint(self.data_dir)
        try:
            self.recovery = self._recover()
        except BaseException:
            self._close_files()
            raise
        self.flusher = new_flusher(
            self.message_log,
            self.config.flush,
            self.config.flush_interval_ms,
            self.config.commit_window_ms,
            recovery_point=self._recovery_point,
        )
        self._stop = threading.Event()
        self._background: threading.Thread | None = None
        if self.config.background:
            self._background = threading.Thread(target=self._background_loop, name="qmq-store-bg", daemon=True)
            self._background.start()
        self.scrub: Scrub | None = None
        if self.config.background and self.config.scrub and self.recovery.scanned_from > self.start_offset:
            self.scrub = Scrub(self.message_log, self.recovery.scanned_from, self._report_damage)
            self.scrub.start()

    # ---- opening ----------------------------------------------------------------------------

    def _recover(self) -> RecoveryReport:
        """Check the log, then bring the derived logs up to its end (module recovery.py)."""
        start = self.message_log.start_offset
        try:
            checkpoint = ckpt.load(self._checkpoint_dir)
        except ckpt.CheckpointError as exc:
            log.warning("%s: rebuilding the derived logs from the message log", exc)
            checkpoint = None
        if checkpoint is not None:
            problem = checkpoint_problem(
                checkpoint,
                self.message_log,
                self._consume_dir,
                self.config.consume_segment_entries,
                self.data_dir / "index",
            )
            if problem is not None:
                log.warning("%s: discarding the checkpoint, rebuilding the derived logs from the message log", problem)
                checkpoint = None
        rebuild = self.config.repair or (checkpoint is None and self.message_log.end_offset > start)
        if rebuild:
            checkpoint = ckpt.Checkpoint(offset=start, next_seq=self._sequences_on_disk(checkpoint))
            self._reset_derived()
        checkpoint = checkpoint or ckpt.Checkpoint(offset=start)
        scan_from = start
        if not self.config.verify_all_on_open:  # after the checkpoint, and at least the newest segments
            recent = self.message_log.segments[-VERIFY_RECENT_SEGMENTS:][0].base
            scan_from = min(checkpoint.offset, recent)
        report = RecoveryReport(scanned_from=scan_from)
        self._open_derived(checkpoint)
        floor = max(checkpoint.offset, self._durable_point())
        replay(self._validated(scan_from, floor, report), checkpoint.offset, self._derive, report)
        if report.repaired and not rebuild:  # damaged records must leave holes, not stale entries
            checkpoint = ckpt.Checkpoint(offset=start, next_seq=self._sequences_on_disk(checkpoint))
            self._reset_derived()
            self._open_derived(checkpoint)
            replay(self._validated(start, start, RecoveryReport()), start, self._derive, report)
        for subject, consume_log in self._consume_logs.items():
            consume_log.truncate(self._next_seq.get(subject, 0))
        try:
            self.index.prepare(self.message_log.end_offset)
        except OSError as exc:  # a full disk, say: the first append tries again, and its failure is handled
            log.warning("cannot make the first key-index file at open (the first send will try again): %s", exc)
        self.message_log.sync()
        self._save_checkpoint(self._snapshot())
        log.info(
            "store %s open: log %d..%d, %d records replayed, %d torn bytes cut, %d regions repaired",
            self.data_dir,
            start,
            self.message_log.end_offset,
            report.replayed,
            report.truncated_bytes,
            len(report.repaired),
        )
        return report

    def _durable_point(self) -> int:
        """The recovery point recorded after the last fsync, within the log (recovery_point.py)."""
        point = self._recovery_point.load()
        end = self.message_log.end_offset
        if point > end:
            log.error(
                "the message log ends at %d but offset %d was fsynced before: %d bytes that were durable are "
                "missing (file truncated outside the store?)",
                end,
                point,
                point - end,
            )
            point = end
        self._recovery_point.last = point
        return point

    def _sequences_on_disk(self, checkpoint: ckpt.Checkpoint | None) -> dict[str, int]:
        """A floor for each subject's next sequence when the derived logs are rebuilt, so a subject
        whose records all expired does not start again at 0."""
        floor = dict(checkpoint.next_seq) if checkpoint else {}
        if self._consume_dir.exists():
            for subject_dir in self._consume_dir.iterdir():
                consume_log = ConsumeLog(subject_dir, self.config.consume_segment_entries)
                floor[subject_dir.name] = max(floor.get(subject_dir.name, 0), consume_log.end_seq())
                consume_log.close()
        return floor

    def _open_derived(self, checkpoint: ckpt.Checkpoint) -> None:
        self.index = KeyIndex(self.data_dir / "index", self.config.index_slots, self.config.index_capacity)
        self.index.restore(checkpoint.index)
        self._next_seq = dict(checkpoint.next_seq)
        if self._consume_dir.exists():
            for subject_dir in sorted(self._consume_dir.iterdir()):
                self._consume_log(subject_dir.name)

    def _validated(self, start: int, durable_floor: int, report: RecoveryReport):
        return scan_for_recovery(
            self.message_log,
            start,
            durable_floor,
            repair=self.config.repair,
            quarantine=self.data_dir / "quarantine",
            report=report,
        )

    def _reset_derived(self) -> None:
        """Delete the derived logs to rebuild them. The checkpoint goes first, so a crash half-way
        through leads to another rebuild rather than trust in half-deleted files."""
        (self._checkpoint_dir / ckpt.FILE_NAME).unlink(missing_ok=True)
        if self._checkpoint_dir.exists():
            fsync_dir(self._checkpoint_dir)
        if self.index is not None:
            self.index.close()
            self.index = None
        for consume_log in self._consume_logs.values():
            consume_log.close()
        self._consume_logs.clear()
        shutil.rmtree(self._consume_dir, ignore_errors=True)
        shutil.rmtree(self.data_dir / "index", ignore_errors=True)

    # ---- writing ----------------------------------------------------------------------------

    def append(self, messages: Sequence[Message]) -> list[Appended]:
        """Append a batch; all or nothing. In sync flush mode the batch is durable only once
        `wait_durable(result[-1].end)` / `await durable(...)` returns.

        This is the hot path: one pass encodes the records and derives their entries (`_encode`), then
        one write stores the batch."""
        with self._lock:
            self._check_writable()
            now = time.time_ns() // 1_000_000
            try:
                encoded, results, runs, index_pairs, position = self._encode(messages, now)
            except (StoreError, ProtocolError):
                raise
            except Exception as exc:
                raise StoreError(f"bad message in batch: {exc}") from exc
            start_end, index_state = self.message_log.end_offset, self.index.state()
            try:
                if self.write_hook is not None:
                    self.write_hook("append")
                self.message_log.append(encoded)  # offsets are continuous across segments: as computed
                for subject, (first, entries) in runs.items():
                    self._consume_log(subject).write(first, b"".join(entries))
                self.index.add(index_pairs)
            except OSError as exc:  # disk full, I/O error: a partial record may be on disk
                first_seqs = {subject: run[0] for subject, run in runs.items()}
                _rewind(self._next_seq, first_seqs)
                self._undo_append(start_end, index_state, first_seqs, exc)
                raise StoreError(f"the store is read-only: {self.read_only_reason}") from exc
            end = position
        for listener in self.append_listeners:
            listener(end)
        return results

    def append_replicated(self, data: bytes, offset: int, *, sync_now: bool = False) -> int:
        """Append a chunk of the master's message log that begins at `offset` (this log's end):
        whole records, each CRC-checked before any is written (`ChunkError` otherwise), stored byte
        for byte in one write, their consume-log and index entries derived as recovery derives them
        (one write per subject's run of entries). Its fsync is asked for as soon as the log's bytes
        are written, before the derived files (which no acknowledgement waits for): durable once
        `durable(end)` / `flushed(end)` says so. With `sync_now`, the fsync runs on this thread
        instead, after the derived files, and the chunk is durable on return (`Flusher.sync_now`).
        Returns the new end."""
        checked = check_chunk(data, offset)
        subjects = {}
        for subject_b, _first, _entries in checked.runs:
            try:
                subjects[subject_b] = self._subject_names.get(subject_b) or subject_b.decode()
            except UnicodeDecodeError:  # the CRC passed: a master wrote it so
                raise ChunkError(f"replicated chunk at offset {offset}: a subject is not UTF-8", offset) from None
        with self._lock:
            self._check_writable()
            if offset != self.message_log.end_offset:
                raise StoreError(
                    f"replicated chunk at offset {offset}, but the log ends at {self.message_log.end_offset}"
                )
            try:
                self.message_log.append_chunk(data, checked.sizes)
                if not sync_now:
                    self.flusher.request(self.message_log.end_offset)  # runs while the derived files are written
                next_seq = self._next_seq
                for subject_b, first, entries in checked.runs:
                    subject = subjects[subject_b]
                    self._consume_log(subject).write(first, entries)
                    after = first + len(entries) // ENTRY_SIZE
                    if after > next_seq.get(subject, 0):
                        next_seq[subject] = after
                    self._subject_names[subject_b] = subject
                self.index.add(checked.index_pairs)
                for position in checked.blanks:  # rare: a region the master gave up as lost
                    self._derive_lost(rec.decode(data, position, offset))
            except OSError as exc:
                self._fail(exc, "replicated append")  # the replica refetches from its durable point after a reopen
                raise StoreError(f"the store is read-only: {self.read_only_reason}") from exc
            end = self.message_log.end_offset
        if sync_now:
            try:
                self.flusher.sync_now()
            except FlushFailed as exc:
                raise StoreError(f"the store is read-only: {self.read_only_reason}") from exc
        for listener in self.append_listeners:
            listener(end)
        return end

    def _undo_append(self, end: int, index_state: dict, first_seqs: dict[str, int], exc: OSError) -> None:
        """Take back a failed append (the log, consume logs and index as they were before it), then
        turn read-only: for a while if the disk was full, else until reopened."""
        try:
            self.message_log.undo_append(end)
            self.flusher.forget_after(end)
            if self._recovery_point.last > end:
                self._recovery_point.record(end)
            for subject, first in first_seqs.items():
                self._consume_log(subject).truncate(first)
            self.index.restore(index_state)
        except OSError as undo_exc:
            self._fail(undo_exc, f"undoing a failed append ({exc}) failed too")
            return
        self.write_failed(exc, "append")

    def write_failed(self, exc: BaseException, what: str) -> None:
        """A write of the store (or of a server beside it: snapshot, journal) failed with `exc`: out of
        space turns the store read-only until a probe finds space again; anything else until it is
        reopened (disk_space.py)."""
        if is_out_of_space(exc):
            with self._lock:
                if self._out_of_space is None and self._failed is None:
                    self._out_of_space = f"{what} failed: {exc}"
                    self._out_of_space_since = time.monotonic()
                    log.error(
                        "the store is read-only until space is freed (probing every %ss): %s failed: %s",
                        PROBE_INTERVAL_S,
                        what,
                        exc,
                    )
        else:
            self._fail(exc, f"{what} failed")

    def _fail(self, exc: BaseException, what: str) -> None:
        with self._lock:
            if self._failed is None:
                self._failed = exc
                self._failed_reason = f"{what}: {exc}"
                log.critical(
                    "the store is read-only until reopened (which checks the log from its durable point and "
                    "derives the consume logs and index again): %s",
                    self._failed_reason,
                )

    @property
    def out_of_space(self) -> bool:
        """Read-only only because the disk is full (reads and in-memory work go on)."""
        return self._out_of_space is not None and self._failed is None and self.flusher.error is None

    @property
    def read_only_reason(self) -> str | None:
        """Why the store takes no writes now, or None if it does."""
        if self._failed is not None:
            return self._failed_reason
        if self.flusher.error is not None:
            return f"an fsync failed, nothing more is acknowledged until the store is reopened: {self.flusher.error}"
        return self._out_of_space

    def probe_space(self) -> bool:
        """While out of space: if space can be reserved again, take writes again. True if writable."""
        if self._out_of_space is None:
            return self.read_only_reason is None
        if space_available(self.data_dir):
            with self._lock:
                self._out_of_space = None
            log.warning("space is available again: the store takes writes again")
        return self.read_only_reason is None

    def _check_writable(self) -> None:
        if self._closed:
            raise StoreError("the store is closed")
        reason = self.read_only_reason
        if reason is not None:
            raise StoreError(f"the store is read-only: {reason}")

    def _encode(self, messages: Sequence[Message], now: int) -> tuple[list, list, dict, list, int]:
        """Encode a batch at the log's end: (records, results, runs of consume-log entries per subject,
        index pairs, the offset after the batch). Hands out the subjects' sequences, or none if a
        message is refused. Compiled where qmq.store.speedups has it."""
        compiled = speedups.compiled
        if compiled is None:
            return self._encode_py(messages, now)
        *out, seqs = compiled.encode_batch(
            messages,
            self._subject_bytes,
            self._new_subject,
            self._next_seq,
            self.message_log.end_offset,
            now,
            rec.MAGIC,
            MAX_MESSAGE_ID_LEN,
            MAX_KEY_LEN,
            _encode_tags,
            checksum.crc32,
            Appended,
            StoreError,
        )
        self._next_seq.update(seqs)
        return tuple(out)

    def _encode_py(self, messages: Sequence[Message], now: int) -> tuple[list, list, dict, list, int]:
        """`_encode` in Python: one pass encodes each record and derives its consume-log entry and
        index entries at the offset it will get (the reference the compiled loop is held to)."""
        next_seq = self._next_seq
        subject_bytes = self._subject_bytes
        position = self.message_log.end_offset
        runs: dict[str, tuple[int, list[bytes]]] = {}  # subject -> (first seq in batch, entries)
        encoded = []
        results = []
        index_pairs = []
        encode, pack, key_hash, message = rec.encode, pack_entry, rec.key_hash, int(rec.Attr.MESSAGE)
        try:
            for m in messages:
                subject = m.subject
                subject_b = subject_bytes.get(subject) or self._new_subject(subject)
                message_id = m.message_id.encode()
                key = m.key.encode() if m.key else b""
                if not 0 < len(message_id) <= MAX_MESSAGE_ID_LEN or len(key) > MAX_KEY_LEN:
                    raise StoreError(
                        f"message id must be 1-{MAX_MESSAGE_ID_LEN} bytes and key at most "
                        f"{MAX_KEY_LEN} bytes (message id {m.message_id!r})"
                    )
                seq = next_seq.get(subject, 0)
                next_seq[subject] = seq + 1
                run = runs.get(subject)
                if run is None:
                    runs[subject] = run = (seq, [])
                tags = m.tags
                data = encode(
                    message,
                    m.flags,
                    now,
                    seq,
                    subject_b,
                    message_id,
                    key,
                    _encode_tags(tags) if tags else b"",
                    m.payload,
                )
                size = len(data)
                encoded.append(data)
                results.append(_new_tuple(Appended, (position, seq, position + size)))  # not Appended(...)
                run[1].append(pack(position, size, rec.tag_mask(tags) if tags else 0, now))
                index_pairs.append((key_hash(message_id), position))
                if key:
                    index_pairs.append((key_hash(key, subject_b), position))
                position += size
        except Exception:
            _rewind(next_seq, {subject: run[0] for subject, run in runs.items()})
            raise
        return encoded, results, runs, index_pairs, position

    def _new_subject(self, subject: str) -> bytes:
        validate_subject(subject, allow_system=True)
        encoded = subject.encode()
        self._subject_bytes[subject] = encoded
        return encoded

    def _derive(self, records: list[rec.Record]) -> None:
        """Write consume-log entries and index entries for records already in the message log."""
        index_pairs = []
        for r in records:
            if r.is_blank:
                self._derive_lost(r)
                continue
            self._consume_log(r.subject).write(
                r.seq, pack_entry(r.offset, r.size, rec.tag_mask(r.tags) if r.tags else 0, r.store_ts)
            )
            if r.seq + 1 > self._next_seq.get(r.subject, 0):
                self._next_seq[r.subject] = r.seq + 1
            index_pairs.append((rec.key_hash(r.message_id.encode()), r.offset))
            if r.key:
                index_pairs.append((rec.key_hash(r.key.encode(), r.subject.encode()), r.offset))
        self.index.add(index_pairs)

    def _derive_lost(self, blank: rec.Record) -> None:
        """Consume-log entries pointing at a blank record for the messages it says it replaced: they
        keep their sequences, and readers report them unreadable rather than pass a hole."""
        for subject, seq in rec.lost_messages(blank):
            self._consume_log(subject).write(seq, pack_entry(blank.offset, blank.size, 0, blank.store_ts))
            if seq + 1 > self._next_seq.get(subject, 0):
                self._next_seq[subject] = seq + 1

    def _consume_log(self, subject: str) -> ConsumeLog:
        consume_log = self._consume_logs.get(subject)
        if consume_log is None:
            consume_log = ConsumeLog(self._consume_dir / subject, self.config.consume_segment_entries)
            self._consume_logs[subject] = consume_log
        return consume_log

    def append_durable(self, messages: Sequence[Message], timeout: float | None = None) -> list[Appended]:
        """Append and, in sync mode, block until the batch is durable."""
        results = self.append(messages)
        if results and self.config.flush is FlushMode.SYNC:
            self.flusher.wait_durable(results[-1].end, timeout)
        return results

    def wait_durable(self, offset: int, timeout: float | None = None) -> None:
        self.flusher.wait_durable(offset, timeout)

    @property
    def durable_offset(self) -> int:
        """Everything before this message-log offset is on disk."""
        return self.flusher.durable_offset

    async def durable(self, offset: int, *, linger_s: float = 0.0) -> None:
        """Await what an acknowledgement needs for everything before `offset`: its fsync in sync
        flush mode; nothing in async mode (the next periodic flush covers it). `linger_s`: let
        another writer's fsync cover it if one starts within that long (`Flusher.durable`)."""
        if self.config.flush is FlushMode.SYNC:
            await self.flusher.durable(offset, linger_s=linger_s)

    def when_durable(self, offset: int, callback: Callable[[BaseException | None], None]) -> None:
        """`durable` for a caller that settles its own waiters: `callback(error or None)` runs on
        the running loop once an acknowledgement may go out for everything before `offset`."""
        if self.config.flush is FlushMode.SYNC:
            self.flusher.when_durable(offset, callback)
        else:
            asyncio.get_running_loop().call_soon(callback, None)

    async def flushed(self, offset: int) -> None:
        """Await the fsync of everything before `offset`, whatever the flush mode: for state saved
        beside the log (a snapshot) that must never get ahead of it."""
        await self.flusher.durable(offset)

    # ---- reading ----------------------------------------------------------------------------

    @property
    def start_offset(self) -> int:
        """The message log's first offset still held (retention removes whole segments)."""
        return self.message_log.start_offset

    def read_bytes(self, start: int, end: int) -> bytes:
        """The message log's bytes from `start` to `end` (record boundaries): records exactly as
        stored, CRCs included, for copies that must stay byte for byte the same."""
        return self.message_log.read_bytes(start, end)

    @property
    def end_offset(self) -> int:
        """The message log's end: the offset the next record gets."""
        return self.message_log.end_offset

    def read_chunk(self, offset: int, max_bytes: int, limit: int | None = None) -> bytes:
        """Whole records of the message log from `offset` (a record boundary), at most `max_bytes`
        unless the first record alone is bigger, never past `limit` (a record boundary; default: the
        log's end): what a master ships to a replica."""
        limit = self.message_log.end_offset if limit is None else limit
        if offset >= limit:
            return b""
        if offset + max_bytes >= limit:  # the rest of the log (the usual reply to a caught-up replica):
            return self.message_log.read_bytes(offset, limit)  # ends at a record boundary, no need to walk it
        data = self.message_log.read_bytes(offset, min(limit, offset + max(max_bytes, rec.HEADER_SIZE)))
        whole = whole_prefix(data)
        if whole == 0:
            data = self.message_log.read_bytes(offset, offset + first_record_size(data))
            whole = len(data)
        return data[:whole]

    def scan(self, start: int) -> Iterator[rec.Record]:
        """Every record of the message log from offset `start` (a record boundary) to its end, in
        log order, CRC-checked (`RecordError` at the first bad one)."""
        return self.message_log.scan(max(start, self.message_log.start_offset))

    def subjects(self) -> dict[str, int]:
        """Each subject's next sequence (= number of messages ever stored in it)."""
        with self._lock:
            return dict(self._next_seq)

    def next_seq(self, subject: str) -> int:
        with self._lock:
            return self._next_seq.get(subject, 0)

    def peek_next_seq(self, subject: str) -> int:
        """`next_seq` without waiting for the store's lock (an event loop must not wait for a write
        on another thread): it may not count an append still in progress."""
        return self._next_seq.get(subject, 0)

    def first_seq(self, subject: str) -> int:
        with self._lock:
            consume_log = self._consume_logs.get(subject)
            return consume_log.first_seq if consume_log else 0

    def entries(self, subject: str, seq: int, count: int) -> list[Entry | None]:
        with self._lock:
            consume_log = self._consume_logs.get(subject)
            end = self._next_seq.get(subject, 0)
            if consume_log is None or seq >= end:
                return []
            try:
                return consume_log.read(seq, min(count, end - seq))
            except DamagedEntry as exc:
                self._rebuild_consume_log(subject, str(exc))
                return self._consume_logs[subject].read(seq, min(count, end - seq))

    def _rebuild_consume_log(self, subject: str, problem: str) -> None:
        with self._lock:
            log.warning("%s: rebuilding the consume log of %r from the message log", problem, subject)
            old = self._consume_logs.pop(subject, None)
            if old is not None:
                old.close()
            self._consume_logs[subject] = rebuild_consume_log(
                self.message_log, self._consume_dir / subject, subject, self.config.consume_segment_entries
            )
            self._rebuilds += 1

    def read(
        self,
        subject: str,
        seq: int,
        max_count: int = 32,
        *,
        tags: Sequence[str] = (),
        match_all: bool = False,
        max_scan: int = 4096,
    ) -> ReadResult:
        """Up to `max_count` messages of `subject` from sequence `seq`, skipping those whose tags do not
        match (any of `tags`, or all of them with `match_all`), holes, and messages already removed by
        retention. Examines at most `max_scan` entries, so a selective filter cannot stall a caller."""
        seq = max(seq, self.first_seq(subject))
        wanted = [rec.tag_mask((t,)) for t in tags]
        records: list[rec.Record] = []
        scanned = 0
        while len(records) < max_count and scanned < max_scan:
            batch = self.entries(subject, seq, min(max_scan - scanned, 256))
            if not batch:
                break
            wanted_entries = []
            for entry in batch:
                seq += 1
                scanned += 1
                if entry is None or entry.offset < self.message_log.start_offset:
                    continue
                if wanted and not _mask_matches(entry.tag_mask, wanted, match_all):
                    continue
                wanted_entries.append(entry)
                if len(wanted_entries) >= max_count - len(records):
                    break
            for record in self._read_entries(subject, wanted_entries):
                if record is None or record.attr == _BLANK:
                    continue
                if tags and not _tags_match(record.tags, tags, match_all):
                    continue
                records.append(record)
        return ReadResult(records, seq)

    def _read_entries(self, subject: str, entries: list[Entry]) -> list[rec.Record | None]:
        """The records `entries` of `subject`'s consume log point at, each checked to be the one its
        entry names (subject and sequence). On a mismatch, or an entry pointing at no record, the
        consume log is rebuilt from the message log (rebuild.py) and the entries read again one by
        one; a record that still cannot be read is reported (`unreadable`) and comes back as None."""
        entries = [e for e in entries if (subject, e.seq) not in self.unreadable]
        spans = [(e.offset, e.size) for e in entries]
        try:
            found = self.message_log.read_records(spans)
            wrong, blanks = None, False  # one pass: this runs for every message pulled
            for e, r in zip(entries, found, strict=True):
                if r.attr == _BLANK:
                    blanks = True
                elif r.subject != subject or r.seq != e.seq:
                    where = f"{r.subject!r} seq {r.seq} (offset {e.offset})"
                    wrong = f"consume log of {subject!r} seq {e.seq} points at {where}"
                    break
            if wrong is None:
                if blanks:  # cut out as damaged while open (`lose`)
                    pairs = zip(entries, found, strict=True)
                    return [self._cut_out_message(subject, e) if r.is_blank else r for e, r in pairs]
                return list(found)
        except rec.RecordError as exc:
            wrong = f"consume log of {subject!r}: {exc}"
        self._rebuild_consume_log(subject, wrong)
        out: list[rec.Record | None] = []
        for e in entries:
            fresh = self.entries(subject, e.seq, 1)
            entry = fresh[0] if fresh else None
            if entry is None:
                out.append(None)  # no readable record has this sequence
                self._report_unreadable(subject, e.seq, e.offset, "no readable record has this sequence")
                continue
            try:
                [record] = self.message_log.read_records([(entry.offset, entry.size)])
            except rec.RecordError as exc:
                self._report_unreadable(subject, e.seq, entry.offset, exc.reason)
                out.append(None)
                continue
            if record.is_blank:  # an entry the rebuild pointed at a cut-out message's blank
                record = self._cut_out_message(subject, e)
            out.append(record if record is not None and record.subject == subject and record.seq == e.seq else None)
        return out

    def _report_damage(self, path: str, offset: int, end: int, reason: str) -> None:
        """A damaged region of the message log, [offset, end), found by the scrub."""
        with self._lock:
            self.damaged.append((path, offset, reason))
            region = self.damage.add(offset, end, path, reason)
        log.error(
            "damaged record in %s at offset %d: %s (%s; `qmq log repair` quarantines it)",
            path,
            offset,
            reason,
            "readers skip it" if region.lost else "to be mended from a group member",
        )

    def _report_unreadable(self, subject: str, seq: int, offset: int, reason: str) -> None:
        """A message that cannot be read from the message log: reported once (log with file and
        offset), kept in `unreadable` so readers move past it."""
        if (subject, seq) in self.unreadable:
            return
        segment = self.message_log.segment_for(offset)
        where = f"{segment.path} offset {offset}" if segment is not None else f"offset {offset}"
        with self._lock:
            self.unreadable[(subject, seq)] = f"{where}: {reason}"
            region = self._note_region(offset, reason)
            if region is not None:
                self.damage.unreadable_at[(subject, seq)] = offset
            mendable = region is not None and not region.lost
        log.error(
            "message %r seq %d cannot be read (%s): %s; %s",
            subject,
            seq,
            where,
            reason,
            "to be mended from a group member" if mendable else "readers skip it",
        )

    def _cut_out_message(self, subject: str, entry: Entry) -> None:
        self._report_unreadable(subject, entry.seq, entry.offset, "cut out as damaged, its bytes are in quarantine/")

    def _note_region(self, offset: int, reason: str) -> DamagedRegion | None:
        """The damaged region starting at `offset`, noted in `damage`, if the message log's record
        there really fails its checks (not only an entry pointing at it); else None."""
        segment = self.message_log.segment_for(offset)
        if segment is None:
            return None
        try:
            self.message_log.read_record(offset)
            return None
        except rec.RecordError:
            pass
        return self.damage.add(offset, self.message_log.damage_end(offset), str(segment.path), reason)

    def note_damage(self, offset: int, how: str) -> None:
        """Another member found our record at `offset` damaged (a replica's CRC check): note the
        region, to be mended or cut out, unless the record is good here (then the copy was damaged
        on its way and the replica fetches it again)."""
        if not self.start_offset <= offset < self.durable_offset:
            return
        with self._lock:
            known = self.damage.covering(offset) is not None
            region = self._note_region(offset, how)
        if region is not None and not known:
            log.error("damaged record in %s (%s): %s", region.where(), how, "to be mended from a group member")

    def mend(self, start: int, data: bytes) -> list[tuple[str, int]]:
        """Write a group member's copy of the damaged region at `start` over it, once every record of
        the copy passes its CRC and the copy fills the region exactly (a member's log is the same
        bytes at the same offsets). Durable before this returns; the consume-log and index entries
        of its records are written again. Returns the (subject, seq) of the messages it made readable
        again. Raises `StoreError` if the copy does not fit."""
        _pieces, records = split_chunk(data, start)  # ChunkError (a ValueError) for a bad copy
        with self._lock:
            region = self.damage.regions.get(start)
            segment = self.message_log.segment_for(start)
            if region is None or region.end != start + len(data) or segment is None or region.end > segment.end:
                raise StoreError(f"a copy of {len(data)} bytes at offset {start} does not fill a damaged region")
            try:
                pwrite_all(segment.fd, data, start - segment.base)
                os.fdatasync(segment.fd)
            except OSError as exc:
                self.write_failed(exc, "mending a damaged record")
                raise StoreError(f"cannot mend offset {start}: {exc}") from exc
            known = {o for r in records for o in self.index.find(rec.key_hash(r.message_id.encode()))}
            for r in records:
                if not r.is_blank:
                    entry = pack_entry(r.offset, r.size, rec.tag_mask(r.tags) if r.tags else 0, r.store_ts)
                    self._consume_log(r.subject).write(r.seq, entry)
            pairs = []
            for r in records:
                if r.offset not in known:  # the index was rebuilt while the record was damaged
                    pairs.append((rec.key_hash(r.message_id.encode()), r.offset))
                    if r.key:
                        pairs.append((rec.key_hash(r.key.encode(), r.subject.encode()), r.offset))
            self.index.add(pairs)
            hidden = self.damage.mend(region)
            for key in hidden:
                self.unreadable.pop(key, None)
            self.damaged = [d for d in self.damaged if not region.start <= d[1] < region.end]
        log.warning("damaged region %s..%d mended: %d records good again", region.where(), region.end, len(records))
        return hidden

    def lose(self, start: int, why: str) -> list[tuple[str, int]]:
        """Give up the damaged region at `start`: its bytes go to `quarantine/` and a blank record of
        the same size takes their place (as `qmq log repair` does), so the log reads and replicates
        past it with every offset kept; its messages stay unreadable (the broker dead-letters them).
        Returns their (subject, seq) as far as readers met them."""
        with self._lock:
            region = self.damage.regions.get(start)
            if region is None:
                return []
            hidden = self.damage.lose(region)
            saved = self._cut_out(region)
        log.error(
            "damaged region %s..%d cannot be mended (%s): its messages are lost%s",
            region.where(),
            region.end,
            why,
            f"; its bytes are in {saved}" if saved else "",
        )
        return hidden

    def _cut_out(self, region: DamagedRegion) -> Path | None:
        """Cover `region` with a blank record, its bytes saved to quarantine/ (None if it cannot be)."""
        segment = self.message_log.segment_for(region.start)
        size = region.end - region.start
        if segment is None or region.end > segment.end or size < rec.HEADER_SIZE:
            return None
        saved = self.data_dir / "quarantine" / f"{segment.path.name}.{region.start:020d}.bad"
        blank = rec.encode_blank(size, lost=self._messages_in(region))
        try:
            saved.parent.mkdir(exist_ok=True)
            saved.write_bytes(segment.read(region.start - segment.base, size))
            pwrite_all(segment.fd, blank, region.start - segment.base)
            os.fdatasync(segment.fd)
        except OSError as exc:
            self.write_failed(exc, "cutting out a damaged record")
            return None
        return saved

    def _messages_in(self, region: DamagedRegion) -> list[tuple[str, int]]:
        """The (subject, seq) of the messages whose records lay in `region`: those readers met, and
        those a consume log points into it."""
        found = set(self.damage.hidden_by(region))
        for subject in list(self._next_seq):
            found.update((subject, seq) for seq in self._seqs_in(subject, region.start, region.end))
        return sorted(found)

    def _seqs_in(self, subject: str, start: int, end: int) -> list[int]:
        """The sequences of `subject` whose entries point into [start, end): a binary search on the
        consume log (its offsets grow with the sequence), then a scan while they stay inside."""

        def first_entry(seq: int) -> Entry | None:  # the first entry at or after `seq`
            while True:
                batch = self.entries(subject, seq, SEARCH_BATCH)
                if not batch:
                    return None
                found = next((e for e in batch if e is not None), None)
                if found is not None:
                    return found
                seq += len(batch)

        lo, hi = self.first_seq(subject), self._next_seq.get(subject, 0)
        while lo < hi:
            mid = (lo + hi) // 2
            entry = first_entry(mid)
            if entry is not None and entry.offset < start:
                lo = max(mid, entry.seq) + 1
            else:
                hi = mid
        seqs = []
        entry = first_entry(lo)
        while entry is not None and entry.offset < end:
            seqs.append(entry.seq)
            entry = first_entry(entry.seq + 1)
        return seqs

    def read_record(self, offset: int) -> rec.Record:
        return self.message_log.read_record(offset)

    def records(self, subject: str, seqs: Sequence[int]) -> list[rec.Record]:
        """The records of `subject` at consume-log sequences `seqs`, in that order, leaving out those
        retention removed and holes."""
        wanted = []
        start = self.message_log.start_offset
        for seq in seqs:
            entries = self.entries(subject, seq, 1)
            if entries and entries[0] is not None and entries[0].offset >= start:
                wanted.append(entries[0])
        return [r for r in self._read_entries(subject, wanted) if r is not None and not r.is_blank]

    def find_by_id(self, message_id: str) -> rec.Record | None:
        """The record with this message id, or None; a bounded number of reads (index.py)."""
        found = self._find_indexed(rec.key_hash(message_id.encode()), lambda r: r.message_id == message_id)
        return found[0] if found else None

    def find_all_by_id(self, message_id: str) -> list[rec.Record]:
        """Every record with this message id, oldest first: a broker's retry and dead-letter copies of
        a message keep its id (`qmq admin lookup`)."""
        found = self._find_indexed(rec.key_hash(message_id.encode()), lambda r: r.message_id == message_id)
        return sorted(found, key=lambda r: r.offset)

    def find_by_key(self, subject: str, key: str) -> list[rec.Record]:
        """Records of `subject` with this key, newest first."""
        return self._find_indexed(
            rec.key_hash(key.encode(), subject.encode()), lambda r: r.subject == subject and r.key == key
        )

    def _find_indexed(self, h: int, accept) -> list[rec.Record]:
        """Records the index gives for hash `h` that `accept` confirms, newest first; looked up again
        if an entry pointing at no record made the index be rebuilt meanwhile."""
        for _attempt in range(2):
            rebuilds = self._rebuilds
            found = []
            for offset in self.index.find(h):
                record = self._indexed_record(offset)
                if record is not None and accept(record):
                    found.append(record)
            if self._rebuilds == rebuilds:
                break
        return found

    def _indexed_record(self, offset: int) -> rec.Record | None:
        """The record an index entry points at. An entry pointing inside a record or at damage gets
        the index rebuilt from the message log (the caller's look-up then misses this once)."""
        if offset < self.message_log.start_offset or offset >= self.message_log.end_offset:
            return None
        try:
            return self.message_log.read_record(offset)
        except rec.RecordError as exc:
            if self._index_rebuilt_at == self.message_log.end_offset:
                return None  # rebuilt already: the record itself is damaged
            with self._lock:
                log.warning("key index entry points at %s: rebuilding the index from the message log", exc)
                self.index.close()
                self.index = rebuild_index(
                    self.message_log, self.data_dir / "index", self.config.index_slots, self.config.index_capacity
                )
                self._index_rebuilt_at = self.message_log.end_offset
                self._rebuilds += 1
            return None

    # ---- checkpoint and retention -------------------------------------------------------------

    def _snapshot(self) -> tuple[ckpt.Checkpoint, list[int]]:
        with self._lock:
            checkpoint = ckpt.Checkpoint(self.message_log.end_offset, dict(self._next_seq), self.index.state())
            fds = self.index.take_dirty_fds()
            for consume_log in self._consume_logs.values():
                fds.extend(consume_log.take_dirty_fds())
        return checkpoint, fds

    def _save_checkpoint(self, snapshot: tuple[ckpt.Checkpoint, list[int]]) -> None:
        checkpoint, fds = snapshot
        try:
            for fd in fds:
                os.fsync(fd)
        except OSError as exc:  # never retried as if it had worked (disk_space.py)
            self._fail(exc, "fsync of the derived logs for a checkpoint")
            raise
        finally:
            for fd in fds:
                os.close(fd)
        try:
            if self.write_hook is not None:
                self.write_hook("checkpoint")
            ckpt.save(self._checkpoint_dir, checkpoint)
        except OSError as exc:
            self.write_failed(exc, "checkpoint")
            raise
        with self._checkpointed:
            self.checkpoint_offset = checkpoint.offset
            self._checkpointed.notify_all()

    def wait_checkpoint(self, offset: int, timeout: float | None = None) -> bool:
        """Block until a checkpoint covers `offset`; False on timeout."""
        with self._checkpointed:
            return self._checkpointed.wait_for(lambda: self.checkpoint_offset >= offset, timeout)

    def checkpoint(self) -> None:
        """Make the derived logs durable up to the current end and record it. Not after a failed
        append: the derived logs may lack its records, which the next open derives again."""
        if self.read_only_reason is not None:
            return
        snapshot = self._snapshot()
        try:
            self.flusher.wait_durable(snapshot[0].offset)
        except BaseException:
            for fd in snapshot[1]:
                os.close(fd)
            raise
        self._save_checkpoint(snapshot)

    def clean(self, now: float | None = None) -> int:
        """Delete message-log segments whose last write is older than the retention, and the derived
        segments that only point into them. The active segment is never deleted. Returns how many
        message-log segments went."""
        cutoff = (now if now is not None else time.time()) - self.config.retention_s
        with self._lock:
            expired_end = None
            for segment in self.message_log.segments[:-1]:
                if segment.mtime() >= cutoff:
                    break
                expired_end = segment.end
            if expired_end is None:
                return 0
            removed = self.message_log.remove_segments_before(expired_end)
            start = self.message_log.start_offset
            for subject, consume_log in self._consume_logs.items():
                consume_log.remove_segments_before(start, self._next_seq.get(subject, 0))
            self.index.remove_files_before(start)
        for segment in removed:
            log.info("retention: deleted %s", segment.path.name)
        return len(removed)

    def _background_loop(self) -> None:
        """Checkpoint every interval or every `checkpoint_bytes` appended, whichever comes first, so
        recovery never has much to replay; clean every `clean_interval_s`."""
        next_clean = time.monotonic() + self.config.clean_interval_s
        next_checkpoint = time.monotonic() + self.config.checkpoint_interval_s
        last_offset = self.message_log.end_offset
        next_probe = 0.0
        while not self._stop.wait(BACKGROUND_TICK_S):
            try:
                now = time.monotonic()
                if self._out_of_space is not None and now >= next_probe:
                    next_probe = now + PROBE_INTERVAL_S
                    self.probe_space()
                grown = self.message_log.end_offset - last_offset
                if now >= next_checkpoint or grown >= self.config.checkpoint_bytes:
                    last_offset = self.message_log.end_offset
                    self.checkpoint()
                    next_checkpoint = now + self.config.checkpoint_interval_s
                if now >= next_clean:
                    self.clean()
                    next_clean = time.monotonic() + self.config.clean_interval_s
            except Exception:
                log.exception("store background work failed; retrying at the next interval")

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        if self.scrub is not None:
            self.scrub.stop()
        if self._background is not None:
            self._background.join()
        self.flusher.close()
        if self.read_only_reason is None:
            self._save_checkpoint(self._snapshot())
        with self._lock:
            self._close_files()

    def _close_files(self) -> None:
        self._recovery_point.close()
        for consume_log in self._consume_logs.values():
            consume_log.close()
        if self.index is not None:
            self.index.close()
        self.message_log.close()
        os.close(self._lock_fd)

    def __enter__(self) -> LogStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _encode_tags(tags: Sequence[str]) -> bytes:
    return rec.TAG_SEPARATOR.join(validate_tags(tags)).encode()


def _rewind(next_seq: dict[str, int], first: dict[str, int]) -> None:
    """Undo the sequences handed out to a batch that was refused."""
    for subject, seq in first.items():
        if seq == 0:
            next_seq.pop(subject, None)
        else:
            next_seq[subject] = seq


def _mask_matches(mask: int, wanted: list[int], match_all: bool) -> bool:
    if match_all:
        return all(mask & w == w for w in wanted)
    return any(mask & w == w for w in wanted)


def _tags_match(have: Sequence[str], wanted: Sequence[str], match_all: bool) -> bool:
    if match_all:
        return all(t in have for t in wanted)
    return any(t in have for t in wanted)


def _fixed_format(data_dir: Path, config: StoreConfig) -> StoreConfig:
    """Settings that decide where bytes live cannot change after a store is created: keep the first
    ones in `store.json` and use them on every later open."""
    path = data_dir / FORMAT_FILE
    saved = read_json(path)
    if saved is not None:
        if saved.get("format") != FORMAT_VERSION:
            raise StoreError(f"{path}: store format {saved.get('format')} is not {FORMAT_VERSION}")
        return replace(config, consume_segment_entries=saved["consume_segment_entries"])
    write_json(path, {"format": FORMAT_VERSION, "consume_segment_entries": config.consume_segment_entries})
    return config


def _lock_directory(data_dir: Path) -> int:
    """Hold an exclusive lock on the data directory for as long as the store is open."""
    fd = os.open(data_dir / "LOCK", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StoreError(f"{data_dir} is in use by another process (pid {holder or 'unknown'})") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd
