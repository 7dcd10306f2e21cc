"""Replication at the store level, shared by the broker and the delay server: what a master ships
and how a replica checks and keeps it (docs/replication.md).

A replica copies the master's message log byte for byte: the master reads whole records from an
offset (`LogStore.read_chunk`), the replica checks every record's CRC before anything is written
(`split_chunk` here: a partial or corrupt chunk is refused whole) and appends them with
`LogStore.append_replicated`, which derives the consume logs and the key index the way recovery
does. Derived files are never copied: each side builds its own from the log.

`truncate_log` cuts a closed store's message log back to an offset (a deposed master whose tail the
new master never had); the cut bytes go to `quarantine/`, the derived files are removed so the next
open rebuilds them from what is left. Nothing here talks to the network.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import NamedTuple

from qmq.store import checksum, speedups
from qmq.store import record as rec
from qmq.store.consume_log import pack_entry
from qmq.store.files import fsync_dir
from qmq.store.recovery_point import RecoveryPoint
from qmq.store.segment import list_segments

log = logging.getLogger("qmq.store")

DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024  # what a replica asks for at most per fetch
CATCH_UP_CHUNK_BYTES = 16 * 1024 * 1024  # per fetch while far behind (a new or wiped replica)
DERIVED_DIRS = ("consumelog", "index", "checkpoint")  # rebuilt from the message log at the next open


class ChunkError(ValueError):
    """A replicated chunk that cannot be trusted: not whole records, or a record fails its CRC
    (`offset`: the log offset of the record that failed, when one did)."""

    def __init__(self, message: str, offset: int | None = None) -> None:
        super().__init__(message)
        self.offset = offset


def whole_prefix(data: bytes) -> int:
    """How many bytes at the start of `data` are whole records (by their size fields; CRCs are the
    replica's to check). The master cuts what it reads at this length."""
    position = 0
    while len(data) - position >= rec.PREFIX.size:
        size, magic = rec.PREFIX.unpack_from(data, position)
        if magic != rec.MAGIC or size < rec.HEADER_SIZE:
            raise ChunkError(f"no record at byte {position} of the chunk (bad magic or size)")
        if position + size > len(data):
            break
        position += size
    return position


def first_record_size(data: bytes) -> int:
    """The size of the record whose header starts `data` (at least 8 bytes)."""
    size, magic = rec.PREFIX.unpack_from(data, 0)
    if magic != rec.MAGIC or size < rec.HEADER_SIZE:
        raise ChunkError("no record at the start of the chunk (bad magic or size)")
    return size


def split_chunk(data: bytes, offset: int) -> tuple[list[bytes], list[rec.Record]]:
    """The records of a chunk that belongs at log `offset`, each CRC-checked: (their bytes, the
    decoded records). Raises `ChunkError` if the chunk is not exactly whole, valid records."""
    pieces: list[bytes] = []
    records: list[rec.Record] = []
    view = memoryview(data)
    position = 0
    while position < len(data):
        try:
            record = rec.decode(data, position, offset)
        except rec.RecordError as exc:
            raise ChunkError(f"replicated chunk at offset {offset}: {exc}", exc.offset) from None
        records.append(record)
        pieces.append(bytes(view[position : position + record.size]))
        position += record.size
    return pieces, records


class CheckedChunk(NamedTuple):
    """What a replica derives from a chunk whose every record passed its checks (`check_chunk`)."""

    sizes: list[int]  # of each record, in order (where a segment may roll)
    runs: list[tuple[bytes, int, bytes]]  # (subject, first seq, packed consume-log entries) per run of seqs
    index_pairs: list[tuple[int, int]]  # (key hash, offset) for the key index, as `LogStore.append` makes them
    blanks: list[int]  # where in the chunk each blank record starts (it may name lost messages)


def check_chunk(data: bytes, offset: int) -> CheckedChunk:
    """Check every record of a chunk that belongs at log `offset` as `record.decode` does (framing,
    field lengths, CRC, attribute) and derive its consume-log and index entries, without building a
    `Record` per message: a replica's hot path, compiled where qmq.store.speedups has it. Raises
    `ChunkError` if the chunk is not exactly whole, valid records (the error of `record.decode` for
    the first bad one)."""
    compiled = speedups.compiled
    if compiled is None:
        return check_chunk_py(data, offset)
    sizes, runs, pairs, blanks, bad = compiled.check_records(
        bytes(data),
        offset,
        rec.MAGIC,
        rec.MAX_RECORD_SIZE,
        int(rec.Attr.MESSAGE),
        int(rec.Attr.BLANK),
        checksum.crc32,
    )
    if bad >= 0:
        _raise_for(data, bad, offset)
    return CheckedChunk(sizes, runs, pairs, blanks)


def check_chunk_py(data: bytes, offset: int) -> CheckedChunk:
    """`check_chunk` in Python: the reference the compiled loop is held to."""
    unpack, crc32, key_hash, tag_mask = rec.HEADER.unpack_from, checksum.crc32, rec.key_hash, rec.tag_mask
    header_size, crc_start, magic_ok, max_size = rec.HEADER_SIZE, rec.CRC_START, rec.MAGIC, rec.MAX_RECORD_SIZE
    message, blank = int(rec.Attr.MESSAGE), int(rec.Attr.BLANK)
    view = memoryview(data)
    total = len(data)
    sizes: list[int] = []
    runs: list[tuple[bytes, int, bytes]] = []
    open_runs: dict[bytes, tuple[int, list[bytes]]] = {}  # subject -> (first seq, entries) of its open run
    pairs: list[tuple[int, int]] = []
    blanks: list[int] = []
    position = 0
    while position < total:
        at = offset + position
        if total - position < header_size:
            _raise_for(data, position, offset)
        size, magic, crc, attr, _flags, ts, seq, s_len, i_len, k_len, t_len, p_len = unpack(data, position)
        end = position + size
        if (
            magic != magic_ok
            or not header_size <= size <= max_size
            or header_size + s_len + i_len + k_len + t_len + p_len != size
            or end > total
            or crc32(view[position + crc_start : end]) != crc
            or (attr != message and attr != blank)
        ):
            _raise_for(data, position, offset)
        sizes.append(size)
        if attr == blank:
            blanks.append(position)
            position = end
            continue
        position = end
        p = at - offset + header_size
        subject = data[p : p + s_len]
        message_id = data[p + s_len : p + s_len + i_len]
        p += s_len + i_len
        key = data[p : p + k_len]
        p += k_len
        try:  # text fields are UTF-8, as `record.decode` checks
            message_id.decode()
            key.decode()
            mask = tag_mask(str(data[p : p + t_len], "utf-8").split(rec.TAG_SEPARATOR)) if t_len else 0
        except UnicodeDecodeError:
            _raise_for(data, position - size, offset)
        pairs.append((key_hash(message_id), at))
        if k_len:
            pairs.append((key_hash(key, subject), at))
        run = open_runs.get(subject)
        if run is not None and run[0] + len(run[1]) != seq:  # not the next of its run (never, from a master)
            runs.append((subject, run[0], b"".join(run[1])))
            run = None
        if run is None:
            open_runs[subject] = run = (seq, [])
        run[1].append(pack_entry(at, size, mask, ts))
    runs.extend((subject, first, b"".join(entries)) for subject, (first, entries) in open_runs.items())
    return CheckedChunk(sizes, runs, pairs, blanks)


def _raise_for(data: bytes, position: int, offset: int) -> None:
    """Raise the `ChunkError` for the record at `position` that failed a check."""
    try:
        rec.decode(data, position, offset)
    except rec.RecordError as exc:
        raise ChunkError(f"replicated chunk at offset {offset}: {exc}", exc.offset) from None
    except UnicodeDecodeError:
        pass
    raise ChunkError(f"replicated chunk at offset {offset}: bad record at {offset + position}", offset + position)


def truncate_log(data_dir: Path, offset: int) -> int:
    """Cut the message log of the (closed) store in `data_dir` back to `offset`, a record boundary.
    The cut bytes are kept in `quarantine/`; the derived files go, to be rebuilt at the next open.
    Returns how many bytes were cut."""
    log_dir = data_dir / "messagelog"
    quarantine = data_dir / "quarantine"
    cut = 0
    for base, path in reversed(list_segments(log_dir)):
        size = path.stat().st_size
        if base + size <= offset:
            break
        quarantine.mkdir(parents=True, exist_ok=True)
        keep = max(0, offset - base)
        saved = quarantine / f"{path.name}.{base + keep:020d}.truncated"
        with path.open("rb") as src:
            src.seek(keep)
            saved.write_bytes(src.read())
        cut += size - keep
        if keep == 0 and base > 0:
            path.unlink()
        else:
            with path.open("r+b") as f:
                f.truncate(keep)
                f.flush()
                os.fsync(f.fileno())
    fsync_dir(log_dir)
    if cut:
        for name in DERIVED_DIRS:
            shutil.rmtree(data_dir / name, ignore_errors=True)
        point = RecoveryPoint(data_dir)
        if point.load() > offset:  # what was cut is not missing: the next open need not say so
            point.record(offset)
            point.close()
        log.warning("message log cut back to offset %d: %d bytes kept in %s", offset, cut, quarantine)
    return cut
