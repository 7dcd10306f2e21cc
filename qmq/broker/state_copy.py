"""A new or wiped broker replica starts from a copy of the master's consumption state when the
master's retention removed the log it would need (docs/replication.md: "A new or wiped broker
replica").

Consumer positions, pull logs, retries and dead-letter marks live in the `%ACTION%` journal of the
message log, which is kept 72 h; a group idle for longer has no journal entry left. A replica
whose fetch offset retention removed (new, wiped, away too long) therefore copies the state:

- **REPL_SNAPSHOT** (on the master): `BrokerState.to_snapshot()` taken on the event loop, once the
  journal it covers is durable; `log_start`, the base of the master's first segment; and for every
  subject its sequence at `log_start` (`floors`: the first sequence whose record is at or after
  it, with the consume-log entry before it). The copy is held in memory, sealed with a CRC, and
  named in the reply with its size.
- **REPL_SNAPSHOT_READ**: up to 4 MiB of that copy; `gone` once the master dropped it (it keeps
  the last `KEPT_COPIES`): the replica asks for a new one.
- **install** (blocking, the replica's store closed): a marker `snapshot.installing` first; the
  old log store and consumption state go; the message log begins, empty, at `log_start` (so the
  segment files match the master's); each subject's consume log gets the entry before its floor
  and the store checkpoint the floors, so sequences go on where the master's do (a group's
  cursor, a dead-letter mark stay meaningful) even for subjects with no record left in the log;
  the copied state becomes `consumers/consumers.snapshot`. The marker goes last. A start that finds
  it (a crash mid-install) wipes the directory back to empty (`discard_interrupted`): the replica
  then copies again, never half of a copy.

Then the replica fetches the whole retained log from `log_start` (consumers need every retained
message), derives its consume logs from it as usual, and applies the journal entries after the
snapshot's `journal_seq` as they arrive (replica_state.py); it counts as in sync once caught up.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from qmq.broker import snapshot
from qmq.broker.service import STATE_DIR
from qmq.broker.state import BrokerState
from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.fields import bad, field
from qmq.replication import install as install_marker
from qmq.replication.crash_points import crash_point
from qmq.store import checkpoint as ckpt
from qmq.store import epochs as ep
from qmq.store.consume_log import ConsumeLog, pack_entry
from qmq.store.files import DamagedFile, fsync_dir, read_json, sealed, unsealed
from qmq.store.store import FORMAT_FILE, LogStore, StoreConfig

log = logging.getLogger("qmq.broker")

KIND = "broker"  # in REPL_SNAPSHOT bodies and replies: whose state this is
COPY_VERSION = 1
KEPT_COPIES = 4  # copies a master holds for replicas still reading them (the oldest goes first)
READ_CHUNK_BYTES = 4 * 1024 * 1024  # one REPL_SNAPSHOT_READ reply carries at most this
REPLY_TIMEOUT_S = 30.0
STATE_DIRS = (STATE_DIR,)  # replaced by the copy, beside the log store


class CopyError(Exception):
    """A copy that cannot be used (damaged, or the master dropped it): it is made again."""


@dataclass
class StateCopy:
    """The master's consumption state and where its log begins, checked, not yet installed."""

    log_start: int  # the replica's log begins here (the master's first segment base)
    offset: int  # the master's log end when the state was taken (its journal durable up to here)
    epochs: ep.Epochs
    state: dict[str, Any]  # BrokerState.to_snapshot()
    floors: list[list[Any]]  # [subject, next seq at log_start, entry before it: [offset, size, mask, ts] | None]
    size: int


# ---- the master's side ---------------------------------------------------------------------------


class Copies:
    """The copies a master made for replicas, by name, until they are read (or pushed out)."""

    def __init__(self) -> None:
        self._copies: OrderedDict[str, bytes] = OrderedDict()
        self._names = itertools.count(1)

    def add(self, epoch: int, data: bytes) -> str:
        name = f"consumers-{epoch}-{next(self._names)}"
        self._copies[name] = data
        while len(self._copies) > KEPT_COPIES:
            self._copies.popitem(last=False)
        return name

    def read(self, body: dict[str, Any]) -> dict[str, Any]:
        """REPL_SNAPSHOT_READ: bytes of one copy, never past its size; `gone`: dropped since."""
        name = field(body, "name", str)
        offset = field(body, "offset", int)
        data = self._copies.get(name)
        if data is None:
            return {"data": b"", "gone": True}
        if not 0 <= offset <= len(data):
            raise bad("offset must be within the copy")
        return {"data": data[offset : offset + READ_CHUNK_BYTES], "gone": False}


def sequence_floors(store: LogStore, log_start: int) -> list[list[Any]]:
    """For every subject: its next sequence as of `log_start` (the first whose record is at or
    after it; holes and entries retention removed count as before it), and the consume-log entry
    before that one, if the master still has it. A binary search per subject. Blocking."""
    floors = []
    for subject, end in sorted(store.subjects().items()):
        lo, hi = store.first_seq(subject), end
        while lo < hi:
            mid = (lo + hi) // 2
            found = store.entries(subject, mid, 1)
            if found and found[0] is not None and found[0].offset >= log_start:
                hi = mid
            else:
                lo = mid + 1
        if lo == 0:
            continue  # every record of the subject is in the retained log: nothing to carry over
        before = store.entries(subject, lo - 1, 1)
        entry = before[0] if before else None
        kept = None
        if entry is not None and entry.offset < log_start:
            kept = [entry.offset, entry.size, entry.tag_mask, entry.store_ts]
        floors.append([subject, lo, kept])
    return floors


def pack_copy(state: dict[str, Any], *, log_start: int, offset: int, floors: list[list[Any]]) -> bytes:
    body = {"version": COPY_VERSION, "state": state, "log_start": log_start, "offset": offset, "floors": floors}
    return sealed(msgpack.packb(body, use_bin_type=True))


def unpack_copy(data: bytes, epochs: ep.Epochs) -> StateCopy:
    """The copy's content, checked (CRC, version, a state that loads); `CopyError` otherwise."""
    try:
        packed = unsealed(data, Path("(copy)"), "consumption state copy")
        body = msgpack.unpackb(packed, raw=False, strict_map_key=False)
        if body.get("version") != COPY_VERSION:
            raise CopyError(f"copy version {body.get('version')} is not {COPY_VERSION}")
        BrokerState.from_snapshot(body["state"], 0.0)  # loads, or is refused here rather than at start
        return StateCopy(
            int(body["log_start"]), int(body["offset"]), epochs, body["state"], list(body["floors"]), len(data)
        )
    except (DamagedFile, ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise CopyError(f"the master's consumption state does not check out: {exc}") from exc


# ---- the replica's side --------------------------------------------------------------------------


async def copy(master: str, *, group: str, replica: str, epoch: int, token: str | None) -> StateCopy:
    """Copy `master`'s consumption state (in memory: it is a few MiB at most), checked; `CopyError`
    (or a connection error) when it must be made again."""
    host, _, port = master.rpartition(":")
    conn = await AsyncConnection.open(host, int(port), token=token, client_id=f"replica-{replica}")
    try:
        head = await conn.request(
            RequestCode.REPL_SNAPSHOT,
            {"group": group, "replica": replica, "epoch": epoch, "kind": KIND},
            timeout=REPLY_TIMEOUT_S,
        )
        if head.get("kind") != KIND:
            raise CopyError(f"{master} answered with a snapshot of a {head.get('kind')!r}, not a broker's")
        name, size, master_epoch = str(head["name"]), int(head["size"]), int(head["epoch"])
        parts = []
        at = 0
        while at < size:
            body = {"epoch": master_epoch, "name": name, "offset": at, "size": size}
            reply = await conn.request(RequestCode.REPL_SNAPSHOT_READ, body, timeout=REPLY_TIMEOUT_S)
            data = reply.get("data") or b""
            if reply.get("gone") or not data:
                raise CopyError(f"the master dropped its copy {name} at {at} of {size} bytes")
            parts.append(bytes(data))
            at += len(data)
    finally:
        await conn.close()
    epochs = [(int(e), int(s)) for e, s in head["epochs"]]
    return unpack_copy(b"".join(parts)[:size], epochs)


def install(data_dir: Path, config: StoreConfig, copy: StateCopy) -> None:
    """Replace the (closed) log store and consumption state of `data_dir` by the copy: the log
    begins empty at `copy.log_start`, each subject's sequence at its floor, the state is the
    master's. A crash part-way leaves the marker, and the next start wipes the directory
    (`discard_interrupted`). Blocking."""
    with install_marker.installing(data_dir, f"the master's consumption state, log from {copy.log_start}", STATE_DIRS):
        install_marker.start_log_at(data_dir, copy.log_start)
        _write_floors(data_dir, config, copy)
        crash_point("snapshot-install")  # tests: the log begun, the state not yet in place
        snapshot.save(data_dir / STATE_DIR, copy.state, log_end=copy.offset)
        ep.save(data_dir, copy.epochs)
    log.warning(
        "installed a copy of the master's consumption state (journal sequence %d, %d bytes, %d subjects carried "
        "over): the log is fetched from %d",
        int(copy.state["journal_seq"]),
        copy.size,
        len(copy.floors),
        copy.log_start,
    )


def _write_floors(data_dir: Path, config: StoreConfig, copy: StateCopy) -> None:
    """Each subject's consume log holds the entry before its floor (pointing below the log start,
    as an entry whose record retention removed), and the checkpoint at `log_start` names the floors:
    the store opens with every subject's sequence where the master's was at `log_start`."""
    saved = read_json(data_dir / FORMAT_FILE)  # the store's fixed format: how many entries a segment holds
    per = int(saved["consume_segment_entries"]) if saved else config.consume_segment_entries
    consume_dir = data_dir / "consumelog"
    next_seq = {}
    for subject, floor, entry in copy.floors:
        offset, size, mask, store_ts = entry if entry and int(entry[0]) < copy.log_start else (0, 0, 0, 0)
        consume_log = ConsumeLog(consume_dir / subject, per)
        try:
            consume_log.write(int(floor) - 1, pack_entry(int(offset), int(size), int(mask), int(store_ts)))
            for fd in consume_log.take_dirty_fds():
                os.fsync(fd)
                os.close(fd)
        finally:
            consume_log.close()
        next_seq[subject] = int(floor)
    if consume_dir.is_dir():
        fsync_dir(consume_dir)
    ckpt.save(data_dir / "checkpoint", ckpt.Checkpoint(offset=copy.log_start, next_seq=next_seq, index=None))


def discard_interrupted(data_dir: Path) -> bool:
    """At start: an install that a crash cut short is wiped (qmq.replication.install)."""
    return install_marker.discard_interrupted(data_dir, STATE_DIRS)


def refuse(kind: Any) -> None:
    """A REPL_SNAPSHOT that asks for another kind of server's state (a delay server's)."""
    if kind not in (None, KIND):
        raise RemoteError(ErrorCode.BAD_REQUEST, f"this is a broker: it has no {kind}'s snapshot")
