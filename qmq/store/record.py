"""The message-log record: the one byte layout every store file derives from (docs/formats.md).

A record is self-describing and self-checking: its size comes first, then a magic, then a CRC-32 of
everything after the CRC. Integers are big-endian. Nothing here does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import NamedTuple

from qmq.store import checksum

MAGIC = 0x514D5101  # "QMQ" + layout version 1
# size, magic, crc, attr, flags, store_ts_ms, seq, subject_len, id_len, key_len, tags_len, payload_len
HEADER = struct.Struct(">IIIBBQQHBHHI")
HEADER_SIZE = HEADER.size  # 41
CRC_START = 12  # the CRC covers bytes [CRC_START, size)
PREFIX = struct.Struct(">II")  # size, magic: enough to frame a record
PREFIX_CRC = struct.Struct(">III")  # size, magic, crc
META = struct.Struct(">BBQQHBHHI")  # the header after the CRC
TAG_SEPARATOR = ","  # tags may not contain it (see qmq.protocol.limits.TAG_RE)
MAX_RECORD_SIZE = 64 * 1024 * 1024  # bigger than any message limit: a size over this is corruption


class Attr(IntEnum):
    MESSAGE = 0
    BLANK = 2  # a region cut out by `repair`: skipped by readers, keeps offsets stable


_MESSAGE, _BLANK = int(Attr.MESSAGE), int(Attr.BLANK)  # plain ints: compared once per record read


class RecordError(Exception):
    """A record that cannot be trusted: why, and at which log offset."""

    def __init__(self, offset: int, reason: str) -> None:
        super().__init__(f"offset {offset}: {reason}")
        self.offset = offset
        self.reason = reason


class TruncatedRecord(RecordError):
    """The bytes end before the record does: a torn tail, or simply more to read."""


_new_tuple = tuple.__new__


class Record(NamedTuple):
    offset: int
    size: int
    attr: int
    flags: int
    store_ts: int  # milliseconds since the epoch
    seq: int  # this record's place in its subject's consume log
    subject: str
    message_id: str
    key: str | None
    tags: tuple[str, ...]
    payload: bytes

    @property
    def is_blank(self) -> bool:
        return self.attr == Attr.BLANK

    @property
    def end(self) -> int:
        return self.offset + self.size


def tag_mask(tags) -> int:
    """A 64-bit filter of a message's tags: two bits per tag. A tag is possibly present when all its
    bits are set, and surely absent otherwise; readers confirm against the record's real tags."""
    mask = 0
    for tag in tags:
        h = checksum.crc32(tag.encode())
        mask |= (1 << (h & 63)) | (1 << ((h >> 6) & 63))
    return mask


def key_hash(data: bytes, prefix: bytes = b"") -> int:
    """A stable 64-bit hash for the key index (Python's hash() changes between processes)."""
    if prefix:
        return (checksum.crc32(data, checksum.crc32(prefix)) << 32) | checksum.adler32(data, checksum.adler32(prefix))
    return (checksum.crc32(data) << 32) | checksum.adler32(data)


def encode(
    attr: int,
    flags: int,
    store_ts: int,
    seq: int,
    subject: bytes,
    message_id: bytes,
    key: bytes,
    tags: bytes,
    payload: bytes,
) -> bytes:
    """One record as bytes. Text arguments come already encoded so a batch can reuse them."""
    meta = (
        META.pack(attr, flags, store_ts, seq, len(subject), len(message_id), len(key), len(tags), len(payload))
        + subject
        + message_id
        + key
        + tags
    )
    crc = checksum.crc32(payload, checksum.crc32(meta))
    return b"".join((PREFIX_CRC.pack(CRC_START + len(meta) + len(payload), MAGIC, crc), meta, payload))


# A blank record that replaced damaged messages names them in its payload (the lost note), so that
# every consume log derived from the log later (a replica's, a rebuilt one) still has their sequences,
# pointing at the blank: readers then report them unreadable (dead letters) instead of passing a hole.
LOST_NOTE = struct.Struct(">8sI")  # LOST_MAGIC, how many messages follow
LOST_MAGIC = b"QMQLOST1"
LOST_ITEM = struct.Struct(">QH")  # seq, subject length; the subject's bytes follow


def encode_blank(size: int, store_ts: int = 0, lost: Sequence[tuple[str, int]] = ()) -> bytes:
    """A blank record of exactly `size` bytes (`size >= HEADER_SIZE`), used to cover a cut-out region.
    `lost`: the (subject, seq) of the messages it replaces, as many as its payload has room for."""
    if size < HEADER_SIZE:
        raise ValueError(f"a blank record needs at least {HEADER_SIZE} bytes, got {size}")
    room = size - HEADER_SIZE
    note = _lost_note(lost, room)
    return encode(Attr.BLANK, 0, store_ts, 0, b"", b"", b"", b"", note + bytes(room - len(note)))


def _lost_note(lost: Sequence[tuple[str, int]], room: int) -> bytes:
    if not lost or room < LOST_NOTE.size:
        return b""
    items, used = [], LOST_NOTE.size
    for subject, seq in lost:
        item = LOST_ITEM.pack(seq, len(subject.encode())) + subject.encode()
        if used + len(item) > room:
            break
        items.append(item)
        used += len(item)
    return LOST_NOTE.pack(LOST_MAGIC, len(items)) + b"".join(items)


def lost_messages(record: Record) -> list[tuple[str, int]]:
    """The (subject, seq) a blank record says it replaced; none for a record of another kind, or a
    blank without a lost note (cut by `qmq log repair`, which cannot know them)."""
    if not record.is_blank or bytes(record.payload[: len(LOST_MAGIC)]) != LOST_MAGIC:
        return []
    payload = bytes(record.payload)
    _magic, count = LOST_NOTE.unpack_from(payload)
    out, pos = [], LOST_NOTE.size
    for _ in range(count):
        seq, length = LOST_ITEM.unpack_from(payload, pos)
        pos += LOST_ITEM.size
        out.append((payload[pos : pos + length].decode(), seq))
        pos += length
    return out


def decode(buf, pos: int, base_offset: int) -> Record:
    """Decode the record at `buf[pos:]`, whose log offset is `base_offset + pos`.

    Raises `TruncatedRecord` if `buf` ends first and `RecordError` if the bytes are not a valid record.
    """
    offset = base_offset + pos
    avail = len(buf) - pos
    if avail < HEADER_SIZE:
        if avail >= 8:
            _check_prefix(buf, pos, offset)
        raise TruncatedRecord(offset, f"{avail} bytes left, a record header needs {HEADER_SIZE}")
    (size, magic, crc, attr, flags, ts, seq, subject_len, id_len, key_len, tags_len, payload_len) = HEADER.unpack_from(
        buf, pos
    )
    if magic != MAGIC or size < HEADER_SIZE or size > MAX_RECORD_SIZE:
        _check_prefix(buf, pos, offset)
    if HEADER_SIZE + subject_len + id_len + key_len + tags_len + payload_len != size:
        raise RecordError(offset, f"field lengths do not add up to the record size {size}")
    if size > avail:
        raise TruncatedRecord(offset, f"record of {size} bytes, only {avail} present")
    end = pos + size
    actual = checksum.crc32(memoryview(buf)[pos + CRC_START : end])
    if actual != crc:
        raise RecordError(offset, f"CRC mismatch (stored {crc:#010x}, computed {actual:#010x})")
    if attr != _MESSAGE and attr != _BLANK:
        raise RecordError(offset, f"unknown record attribute {attr}")
    p = pos + HEADER_SIZE
    try:  # str(slice, "utf-8") decodes bytes, bytearray and memoryview slices alike, without a copy
        subject = str(buf[p : p + subject_len], "utf-8")
        p += subject_len
        message_id = str(buf[p : p + id_len], "utf-8")
        p += id_len
        key = str(buf[p : p + key_len], "utf-8") if key_len else None
        p += key_len
        tags = tuple(str(buf[p : p + tags_len], "utf-8").split(TAG_SEPARATOR)) if tags_len else ()
        p += tags_len
    except UnicodeDecodeError as exc:
        raise RecordError(offset, f"text field is not UTF-8 ({exc.reason})") from None
    payload = buf[p:end]
    fields = (offset, size, attr, flags, ts, seq, subject, message_id, key, tags, bytes(payload))
    return _new_tuple(Record, fields)  # not Record(...): its __new__ is a Python function, paid per read


def _check_prefix(buf, pos: int, offset: int) -> None:
    size, magic = PREFIX.unpack_from(buf, pos)
    if magic != MAGIC:
        raise RecordError(offset, f"bad magic {magic:#010x}")
    if size < HEADER_SIZE or size > MAX_RECORD_SIZE:
        raise RecordError(offset, f"impossible record size {size}")


def find_next_valid(buf, pos: int, base_offset: int) -> int | None:
    """The position of the first valid record after `pos` in `buf` (bytes, bytearray or mmap), or None.
    Used to tell a torn tail (nothing valid follows) from corruption in the middle (valid records follow)."""
    needle = MAGIC.to_bytes(4, "big")
    start = pos + 1
    while True:
        at = buf.find(needle, start + 4)
        if at < 0:
            return None
        candidate = at - 4
        try:
            decode(buf, candidate, base_offset)
            return candidate
        except RecordError:
            start = candidate + 1
