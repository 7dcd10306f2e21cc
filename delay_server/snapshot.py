"""A new or wiped replica of a delay-server group starts from a copy of the master's schedule
(docs/replication.md: "A new or wiped delay-server replica").

The message log is kept 72 h; pending messages live in the buckets for up to two years. A replica
whose fetch offset retention removed cannot rebuild the buckets from the log, so it copies them:

- **listing** (REPL_SNAPSHOT, on the master, on the event loop): `offset` = how far the master's log
  is filed (`DelayService.filed_upto`), and the size of every file of `schedule/`, `dispatch/` and
  `cancels/` at that moment. Those files are appended on the event loop only, in message-log order,
  so their prefixes of these sizes are exactly the state filed up to `offset`, and stay so: later
  writes only append. (A dispatch log may hold the last deliveries whose notes come after `offset`:
  filing the notes again appends the same positions twice, and dispatch logs are read as sets.)
- **copy** (REPL_SNAPSHOT_READ, on the replica): each file up to its listed size, in 4 MiB reads,
  into `snapshot.partial/`, then checked as `qmq log verify` checks a delay server (CRCs, every index
  entry against its copy). A bucket that retention deleted meanwhile (done, past `--retention`) is
  left out with its dispatch log.
- **install** (blocking, the store closed): a marker file first (`snapshot.installing`), then the
  old log store and delay files go, the copy takes their place, the schedule checkpoint says
  `offset`, the master's epochs are written, and the message log begins, empty, at `log_start` (the
  base of the master's segment holding `offset`, so the segment files match the master's). The
  marker goes last. A start that finds the marker (a crash mid-install) wipes the directory back to
  empty (`discard_interrupted`): the replica then copies a snapshot again, never half of one.

After the install the replica fetches the log from `log_start`; the records before `offset` are
in the copy already, so filing resumes at `offset` (`DelayService.recover`). Positions in buckets
are the master's, byte for byte, so the dispatch notes that follow name the same messages here.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from delay_server.dispatch_log import DONE_SUFFIX
from delay_server.dispatch_log import SUFFIX as DISPATCH_SUFFIX
from delay_server.schedule_log import CHECKPOINT_FILE, INDEX_SUFFIX, LOG_SUFFIX
from delay_server.verify import verify_delay_files
from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.fields import bad, field
from qmq.replication import install as install_marker
from qmq.store import epochs as ep
from qmq.store.files import fsync_dir, write_json
from qmq.store.segment import list_segments
from qmq.store.verify import VerifyReport

log = logging.getLogger("qmq.delay")

STATE_DIRS = ("schedule", "dispatch", "cancels")  # what a delay server keeps beside its log store
PARTIAL_DIR = "snapshot.partial"  # a copy being made
READ_CHUNK_BYTES = 4 * 1024 * 1024  # one REPL_SNAPSHOT_READ reply carries at most this
REPLY_TIMEOUT_S = 30.0
NAME = re.compile(r"^(schedule|dispatch|cancels)/[0-9A-Za-z][0-9A-Za-z._-]*$")
SKIPPED = (CHECKPOINT_FILE,)  # the replica writes its own schedule checkpoint


class SnapshotError(Exception):
    """A copy that cannot be used (damaged, or the master changed meanwhile): it is made again."""


@dataclass
class Snapshot:
    """A copy in `<data dir>/snapshot.partial`, checked, not yet installed."""

    offset: int  # the master's log is filed up to here in the copy
    log_start: int  # the replica's log begins here (a segment base, at or before `offset`)
    epochs: ep.Epochs
    files: int
    bytes: int


# ---- the master's side ---------------------------------------------------------------------------


def listing(data_dir: Path, filed_upto: int, epoch: int, epochs: ep.Epochs) -> dict[str, Any]:
    """REPL_SNAPSHOT: what a replica must copy. Call it on the event loop, where filing happens, so
    the sizes and `filed_upto` belong together."""
    files = []
    for part in STATE_DIRS:
        directory = data_dir / part
        if not directory.is_dir():
            continue
        for path in sorted(directory.iterdir()):
            name = f"{part}/{path.name}"
            if path.name in SKIPPED or not NAME.match(name) or not path.is_file():
                continue
            files.append([name, path.stat().st_size])
    bases = [base for base, _ in list_segments(data_dir / "messagelog") if base <= filed_upto]
    return {
        "epoch": epoch,
        "offset": filed_upto,
        "log_start": max(bases, default=0),
        "epochs": [list(e) for e in epochs],
        "files": files,
    }


def read_part(data_dir: Path, body: dict[str, Any]) -> dict[str, Any]:
    """REPL_SNAPSHOT_READ: bytes of one listed file, never past its listed `size` (what follows was
    filed after the listing's offset). `gone`: retention deleted the file since. Blocking."""
    name = field(body, "name", str)
    offset = field(body, "offset", int)
    size = field(body, "size", int)
    if not NAME.match(name) or ".." in name:
        raise bad(f"{name!r} is not a file of a delay server's snapshot")
    if not 0 <= offset <= size:
        raise bad("offset must be between 0 and size")
    try:
        fd = os.open(data_dir / name, os.O_RDONLY)
    except FileNotFoundError:
        return {"data": b"", "gone": True}
    try:
        data = os.pread(fd, min(READ_CHUNK_BYTES, size - offset), offset)
    finally:
        os.close(fd)
    if len(data) < min(READ_CHUNK_BYTES, size - offset):
        raise RemoteError(ErrorCode.UNAVAILABLE, f"{name} is shorter than listed: retry the snapshot")
    return {"data": data, "gone": False}


# ---- the replica's side --------------------------------------------------------------------------


async def copy(data_dir: Path, master: str, *, group: str, replica: str, epoch: int, token: str | None) -> Snapshot:
    """Copy `master`'s schedule, dispatch logs and cancels into `<data_dir>/snapshot.partial` and
    check it; `SnapshotError` (or a connection error) when it must be made again."""
    partial = data_dir / PARTIAL_DIR
    shutil.rmtree(partial, ignore_errors=True)
    host, _, port = master.rpartition(":")
    conn = await AsyncConnection.open(host, int(port), token=token, client_id=f"replica-{replica}")
    try:
        head = await conn.request(
            RequestCode.REPL_SNAPSHOT, {"group": group, "replica": replica, "epoch": epoch}, timeout=REPLY_TIMEOUT_S
        )
        master_epoch = int(head["epoch"])
        gone: set[str] = set()
        copied = 0
        for name, size in head["files"]:
            if not NAME.match(name) or ".." in name:
                raise SnapshotError(f"the master listed {name!r}, not a file of a snapshot")
            target = partial / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:  # an empty file (a done mark) needs no read
                at = 0
                while at < size:
                    body = {"epoch": master_epoch, "name": name, "offset": at, "size": size}
                    reply = await conn.request(RequestCode.REPL_SNAPSHOT_READ, body, timeout=REPLY_TIMEOUT_S)
                    if reply.get("gone"):
                        gone.add(name)
                        break
                    data = reply.get("data") or b""
                    if not data:
                        raise SnapshotError(f"the master sent nothing of {name} at {at} (listed {size} bytes)")
                    out.write(data)
                    at += len(data)
                out.flush()
                os.fsync(out.fileno())
            copied += at
    finally:
        await conn.close()
    for name in gone:
        (partial / name).unlink(missing_ok=True)
    _drop_incomplete_buckets(partial)
    for part in STATE_DIRS:
        (partial / part).mkdir(parents=True, exist_ok=True)
    write_json(partial / "schedule" / CHECKPOINT_FILE, {"version": 1, "offset": int(head["offset"])})
    report = VerifyReport()
    verify_delay_files(partial, report)
    if report.problems:
        raise SnapshotError(f"the copy of {master}'s schedule fails its checks: {'; '.join(report.problems[:5])}")
    for part in STATE_DIRS:
        fsync_dir(partial / part)
    fsync_dir(partial)
    epochs = [(int(e), int(s)) for e, s in head["epochs"]]
    return Snapshot(int(head["offset"]), int(head["log_start"]), epochs, len(head["files"]) - len(gone), copied)


def _drop_incomplete_buckets(partial: Path) -> None:
    """Leave out a bucket one of whose files retention deleted during the copy (a done bucket past
    `--retention`: the master deleted it whole), and dispatch logs and marks of buckets not copied."""
    schedule, dispatch = partial / "schedule", partial / "dispatch"
    names = {p.name.rsplit(".", 1)[0] for p in schedule.glob("*" + LOG_SUFFIX)} if schedule.is_dir() else set()
    whole = {n for n in names if (schedule / (n + INDEX_SUFFIX)).exists()}
    for name in names - whole:
        (schedule / (name + LOG_SUFFIX)).unlink(missing_ok=True)
    if schedule.is_dir():
        for path in schedule.glob("*" + INDEX_SUFFIX):
            if path.name[: -len(INDEX_SUFFIX)] not in whole:
                path.unlink()
    if dispatch.is_dir():
        for path in dispatch.iterdir():
            stem = path.name.rsplit(".", 1)[0]
            if path.suffix in (DISPATCH_SUFFIX, DONE_SUFFIX) and stem not in whole:
                path.unlink()


def install(data_dir: Path, snapshot: Snapshot) -> None:
    """Replace the (closed) log store and delay files of `data_dir` by the checked copy: the log
    begins empty at `snapshot.log_start`, filed up to `snapshot.offset`. A crash part-way leaves
    the marker, and the next start wipes the directory (`discard_interrupted`). Blocking."""
    partial = data_dir / PARTIAL_DIR
    with install_marker.installing(data_dir, f"a snapshot filed up to {snapshot.offset}", STATE_DIRS):
        for part in STATE_DIRS:
            os.replace(partial / part, data_dir / part)
        install_marker.start_log_at(data_dir, snapshot.log_start)
        ep.save(data_dir, snapshot.epochs)
        shutil.rmtree(partial, ignore_errors=True)
    log.warning(
        "installed a copy of the master's schedule filed up to offset %d (%d files, %d bytes): the log is "
        "fetched from %d",
        snapshot.offset,
        snapshot.files,
        snapshot.bytes,
        snapshot.log_start,
    )


def discard_interrupted(data_dir: Path) -> bool:
    """At start: a copy being made is dropped, and an install that a crash cut short wiped
    (qmq.replication.install). Whether an install was."""
    shutil.rmtree(data_dir / PARTIAL_DIR, ignore_errors=True)
    return install_marker.discard_interrupted(data_dir, STATE_DIRS)
