"""What the delay server writes in its logs: a delayed message and a cancel, as log-store records.

Both use the message-log record layout (docs/formats.md). A delayed message keeps its subject, id,
key and tags; its payload is the 8-byte due time (ms since the epoch, big-endian) followed by the
producer's payload, untouched. A cancel is a record of the `%ACTION%` subject named by the id it
cancels; its payload is the time until which the cancel is kept. A dispatch note is a record of the
`%ACTION%` subject saying which messages of one bucket a broker acknowledged: its payload is the
bucket's start (8 bytes, where a due time would be) and their positions in the bucket's `.log` file
(8 bytes each). It puts what the dispatch logs hold into the message log, so a replica, or a
restart that replays the log, knows what was delivered (docs/delay.md). A bucket-done note says a
bucket's every message was delivered or cancelled (its payload: the bucket's start), so a replica
marks it done and deletes it after the retention as the master does. Only `read_file` does I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from pathlib import Path

from qmq.protocol.limits import ACTION_SUBJECT
from qmq.store import record as rec
from qmq.store.store import Message

DELAYED = 0x10  # record flag: a delayed message, payload = due time + producer's payload
CANCEL = 0x20  # record flag: a cancel of the message with this record's id
DISPATCHED = 0x40  # record flag: a dispatch note, payload = bucket start + positions delivered
BUCKET_DONE = 0x80  # record flag: a bucket-done note, payload = bucket start
NOTES = DISPATCHED | BUCKET_DONE  # what the master notes about its own work, not a request's
DUE = struct.Struct(">q")  # the payload's first 8 bytes
POSITION = struct.Struct(">Q")


def delayed(
    subject: str, message_id: str, payload: bytes, key: str | None, tags: Sequence[str], due_ms: int
) -> Message:
    return Message(subject, message_id, DUE.pack(due_ms) + payload, key, tuple(tags), DELAYED)


def cancel(message_id: str, keep_until_ms: int) -> Message:
    return Message(ACTION_SUBJECT, message_id, DUE.pack(keep_until_ms), None, (), CANCEL)


def dispatched(note_id: str, bucket_start_ms: int, positions: Sequence[int]) -> Message:
    """A dispatch note: these positions of the bucket starting at `bucket_start_ms` were delivered.
    `note_id` is an id of its own (the key index must not find it for a message's id)."""
    payload = DUE.pack(bucket_start_ms) + struct.pack(f">{len(positions)}Q", *positions)
    return Message(ACTION_SUBJECT, note_id, payload, None, (), DISPATCHED)


def bucket_done(note_id: str, bucket_start_ms: int) -> Message:
    """A bucket-done note: every message of the bucket starting at `bucket_start_ms` was delivered
    or cancelled."""
    return Message(ACTION_SUBJECT, note_id, DUE.pack(bucket_start_ms), None, (), BUCKET_DONE)


def dispatched_positions(payload: bytes) -> tuple[int, list[int]]:
    """(bucket start ms, positions) of a dispatch note's payload."""
    count = (len(payload) - DUE.size) // POSITION.size
    return DUE.unpack_from(payload, 0)[0], list(struct.unpack_from(f">{count}Q", payload, DUE.size))


def read_file(path: Path) -> tuple[list[rec.Record], rec.RecordError | None]:
    """The records of a file written record after record (a bucket's .log, a cancels file), and the
    error that ended the reading early (a torn tail, or damage), if one did. Positions are offsets."""
    data = path.read_bytes()
    out = []
    pos = 0
    while pos < len(data):
        try:
            record = rec.decode(data, pos, 0)
        except rec.RecordError as exc:
            return out, exc
        out.append(record)
        pos += record.size
    return out, None


def due_of(payload: bytes) -> int:
    return DUE.unpack_from(payload, 0)[0]


def body_of(payload: bytes) -> bytes:
    """The producer's payload (the client's envelope)."""
    return payload[DUE.size :]
