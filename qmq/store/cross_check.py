"""Cross-checking derived data against the message log: a checkpoint is believed only if the consume
logs and the message log agree with what it claims.

A checkpoint says, per subject, how many messages the subject holds (`next_seq`) and how far in the
message log they are derived (`offset`). Each claim is checked where it can be cheaply (one entry and
one record per subject): the entry before `next_seq` must exist and point below `offset` at the
record with that subject and sequence; the entry at `next_seq`, if any, must point at or past
`offset` (else the checkpoint claims fewer messages than the log holds, and new messages would reuse
their sequence numbers). The key-index file the checkpoint names must be there and hold at least the
entries it counts (else look-ups by id of every message before the checkpoint would find nothing). A
record that cannot be read is left to the message log's own checks.
"""

from __future__ import annotations

from pathlib import Path

from qmq.store import record as rec
from qmq.store.checkpoint import Checkpoint
from qmq.store.consume_log import ConsumeLog, DamagedEntry
from qmq.store.index import FILE_MAGIC, HEADER
from qmq.store.message_log import MessageLog
from qmq.store.segment import segment_name


def checkpoint_problem(
    checkpoint: Checkpoint, message_log: MessageLog, consume_dir: Path, entries_per_segment: int, index_dir: Path
) -> str | None:
    """What is wrong with `checkpoint` given the logs on disk, or None if it checks out."""
    start, end = message_log.start_offset, message_log.end_offset
    if not start <= checkpoint.offset <= end:
        return f"checkpoint offset {checkpoint.offset} is outside the message log {start}..{end}"
    problem = _index_problem(checkpoint, index_dir)
    if problem is not None:
        return problem
    subjects = set(checkpoint.next_seq)
    if consume_dir.is_dir():
        subjects |= {p.name for p in consume_dir.iterdir() if p.is_dir()}
    for subject in sorted(subjects):
        consume_log = ConsumeLog(consume_dir / subject, entries_per_segment)
        try:
            problem = _subject_problem(subject, checkpoint, consume_log, message_log)
        except DamagedEntry as exc:
            problem = str(exc)
        finally:
            consume_log.close()
        if problem is not None:
            return problem
    return None


def _index_problem(checkpoint: Checkpoint, index_dir: Path) -> str | None:
    """The key-index file the checkpoint names, checked by its header (the entries it holds)."""
    state = checkpoint.index
    if not state or state.get("file") is None:
        return None
    path = index_dir / segment_name(int(state["file"]))
    try:
        with path.open("rb") as f:
            header = f.read(HEADER.size)
    except FileNotFoundError:
        return f"checkpoint names key-index file {path}, which is missing"
    if len(header) < HEADER.size or HEADER.unpack(header)[0] != FILE_MAGIC:
        return None  # damage: opening it refuses and names `qmq log repair` (index.py)
    held, claimed = HEADER.unpack(header)[3], int(state.get("count") or 0)
    if held < claimed:
        return f"checkpoint says key-index file {path} holds {claimed} entries; it holds {held}"
    return None


def _subject_problem(
    subject: str, checkpoint: Checkpoint, consume_log: ConsumeLog, message_log: MessageLog
) -> str | None:
    claimed = checkpoint.next_seq.get(subject, 0)
    if claimed > 0 and claimed - 1 >= consume_log.first_seq:
        found = consume_log.read(claimed - 1, 1)
        if not found:
            return f"checkpoint says {subject!r} holds {claimed} messages, its consume log has fewer"
        entry = found[0]
        if entry is not None:
            if entry.offset >= checkpoint.offset:
                return f"checkpoint says {subject!r} seq {claimed - 1} is before offset {checkpoint.offset}; it is not"
            mismatch = _record_mismatch(subject, claimed - 1, entry.offset, message_log)
            if mismatch is not None:
                return mismatch
    after = consume_log.read(claimed, 1) if claimed >= consume_log.first_seq else []
    if after and after[0] is not None and after[0].offset < checkpoint.offset:
        return (
            f"checkpoint says {subject!r} holds {claimed} messages before offset {checkpoint.offset}; "
            f"its consume log has more"
        )
    return None


def _record_mismatch(subject: str, seq: int, offset: int, message_log: MessageLog) -> str | None:
    if offset < message_log.start_offset:
        return None  # removed by retention
    try:
        record = message_log.read_record(offset)
    except rec.RecordError:
        return None  # the message log's own checks report it
    if record.subject != subject or record.seq != seq:
        return f"consume log of {subject!r} seq {seq} points at {record.subject!r} seq {record.seq}"
    return None
