"""Snapshots of the broker's consumption state, so a restart replays only the journal after one.

A snapshot is msgpack sealed with its length and CRC-32, written atomically (`qmq.store.files`): a
crash leaves the old or the new one whole. A snapshot that fails its CRC is an error naming the file;
the broker does not guess at positions.

The last `KEPT_SNAPSHOTS` are kept (docs/formats.md): `consumers.snapshot`, the newest, and the ones
before it as `consumers.snapshot.1`, `.2`. Each holds its `journal_seq` (it covers the journal
entries before it) and `log_end` (every journal record it covers ends at or before that offset). A
cut log (a deposed master rejoining its group, docs/replication.md) drops those that cover a journal
record that was cut and goes on from the newest of the others whose journal after it is still in the
log (`keep_within`): re-fetching the log, which a lost snapshot would cost when retention removed
the log's start, is left for when none qualifies.

A master of a replicated group also keeps the newest snapshot at or below what every replica it
knows holds durable (`replicated_upto`), as `consumers.snapshot.replicated`, once the three newest
are all past it; its replicas do the same with that offset as the master tells it to them. A
failover cannot cut the log below that point (the new master is a replica), so however long a split
lasts while consumers go on using the deposed master, a cut finds a snapshot to go on from, as long
as retention kept the journal after it.

Saving rotates the files (`.1` to `.2`, the newest to `.1`, each an atomic rename) and then writes
the new one atomically; a crash in between leaves whole snapshots only, and `load` takes the newest
of them by journal sequence, whatever their names. A directory of the older layout (one
`consumers.snapshot`) loads as it is: its one snapshot is the newest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from qmq.store.files import SEAL, DamagedFile, fsync_dir, sealed, unsealed, write_atomically

log = logging.getLogger("qmq.broker")

FILE_NAME = "consumers.snapshot"  # the newest snapshot
KEPT_SNAPSHOTS = 3  # snapshot files kept: the newest and the two saved before it (a cut may need one)
FILE_NAMES = (FILE_NAME, *(f"{FILE_NAME}.{n}" for n in range(1, KEPT_SNAPSHOTS)))  # newest first
REPLICATED_NAME = f"{FILE_NAME}.replicated"  # set aside: at or below what every replica held
ALL_NAMES = (*FILE_NAMES, REPLICATED_NAME)  # in slot order: the set-aside one is the oldest
PEEK_BYTES = 4096  # read to learn a snapshot's journal sequence and log end without loading it


class SnapshotError(ValueError):
    pass


@dataclass(frozen=True)
class Generation:
    """One kept snapshot file and what it covers."""

    path: Path
    journal_seq: int
    log_end: int | None  # None: saved before snapshots recorded it
    data: dict[str, Any]


def files(directory: Path) -> list[Path]:
    """The snapshot files present, in slot order (newest first, as saved)."""
    return [directory / name for name in ALL_NAMES if (directory / name).exists()]


def read(path: Path) -> dict[str, Any]:
    """One snapshot file's content; `SnapshotError` naming it if it does not check out."""
    try:
        body = unsealed(path.read_bytes(), path, "snapshot")
    except DamagedFile as exc:
        raise SnapshotError(str(exc)) from None
    try:
        data = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise SnapshotError(f"{path}: snapshot does not decode: {exc}") from None
    if not isinstance(data, dict):
        raise SnapshotError(f"{path}: snapshot is not a map")
    return data


def generations(directory: Path) -> tuple[list[Generation], list[str]]:
    """The readable snapshots, newest first (by journal sequence), and a problem per damaged file."""
    found, problems = [], []
    for path in files(directory):
        try:
            data = read(path)
        except SnapshotError as exc:
            problems.append(str(exc))
            continue
        except FileNotFoundError:  # rotated away meanwhile (a reader beside a live broker)
            continue
        log_end = data.pop("log_end", None)  # the file's, not the state's
        found.append(Generation(path, int(data.get("journal_seq", 0)), None if log_end is None else int(log_end), data))
    found.sort(key=lambda g: -g.journal_seq)  # stable: among equals, the earlier slot (the newer) first
    return found, problems


def load(directory: Path) -> dict[str, Any] | None:
    """The newest snapshot (by journal sequence) that checks out; None without one. A damaged one
    is passed over for an older one (logged); `SnapshotError` if every one is damaged."""
    found, problems = generations(directory)
    if not found:
        if problems:
            raise SnapshotError("; ".join(problems))
        return None
    for problem in problems:
        log.warning(
            "%s: discarding the snapshot, using the older one of journal sequence %d", problem, found[0].journal_seq
        )
    return found[0].data


def save(
    directory: Path, snapshot: dict[str, Any], *, log_end: int | None = None, replicated_upto: int | None = None
) -> None:
    """Save `snapshot` (its journal records all end at or before `log_end`, if known, and are
    durable) as the newest; the one it replaces is kept as the previous generation unless it covers
    the same journal, and the oldest beyond `KEPT_SNAPSHOTS` goes, or is set aside if it is the
    newest at or below `replicated_upto` (in a replicated group, where every replica holds the log
    durable, as the master knows it). Blocking."""
    directory.mkdir(parents=True, exist_ok=True)
    newest = directory / FILE_NAME
    body = snapshot if log_end is None else {"log_end": log_end, **snapshot}  # first: peeked at
    data = sealed(msgpack.packb(body, use_bin_type=True))
    if newest.exists() and _peek(newest)[0] != int(snapshot.get("journal_seq", 0)):
        if replicated_upto is not None:
            _set_aside(directory, replicated_upto, log_end)
        for older, newer in zip(reversed(FILE_NAMES[1:]), reversed(FILE_NAMES[:-1]), strict=True):
            with contextlib.suppress(FileNotFoundError):
                os.replace(directory / newer, directory / older)  # atomic: each file stays whole
    write_atomically(newest, data)  # fsyncs the directory: the renames before it too


def _set_aside(directory: Path, upto: int, new_log_end: int | None) -> None:
    """Before a rotation drops the oldest kept snapshot: keep it as the set-aside one if none left
    after the rotation ends at or below `upto` and it does; drop the set-aside one once one left
    does (it is older)."""
    staying = [_peek(directory / name)[1] for name in FILE_NAMES[:-1] if (directory / name).exists()]
    set_aside = directory / REPLICATED_NAME
    if any(end is not None and end <= upto for end in [new_log_end, *staying]):
        with contextlib.suppress(FileNotFoundError):
            set_aside.unlink()
        return
    oldest = directory / FILE_NAMES[-1]
    end = _peek(oldest)[1] if oldest.exists() else None
    if end is not None and end <= upto:
        os.replace(oldest, set_aside)  # the rotation's renames then fsync the directory


def keep_within(directory: Path, journal_end: int, retained: Callable[[int], bool]) -> Generation | None:
    """The journal was cut back to `journal_end` entries: every snapshot covering an entry past it is
    deleted, and the newest of the others whose journal after it is all in the log
    (`retained(journal_seq)`) becomes the newest, the older ones that qualify too behind it; the
    others are deleted. None, every snapshot deleted, if none qualifies. Blocking."""
    found, problems = generations(directory)
    for problem in problems:
        log.warning("%s: deleted", problem)
    kept = [g for g in found if g.journal_seq <= journal_end and retained(g.journal_seq)]
    chosen = kept[0] if kept else None
    kept_paths = {g.path for g in kept}
    for path in files(directory):
        if path not in kept_paths:
            path.unlink()  # covers what was cut, cannot be replayed from, or damaged
    if kept and [g.path for g in kept] == sorted(kept_paths, key=lambda p: ALL_NAMES.index(p.name)):
        for slot, generation in zip(FILE_NAMES, kept, strict=False):  # close the gaps, newest first
            if generation.path.name != slot:
                os.replace(generation.path, directory / slot)  # onto a slot already emptied
        chosen = dataclasses.replace(kept[0], path=directory / FILE_NAME)
    if directory.is_dir():
        fsync_dir(directory)
    return chosen


def _peek(path: Path) -> tuple[int | None, int | None]:
    """The journal sequence and log end a snapshot file names, read from its first bytes without
    checking it (only to decide which files to keep); None for what cannot be told there (a log end
    written after the state, as before it was written first)."""
    found: dict[str, int] = {}
    try:
        with path.open("rb") as f:
            head = f.read(SEAL.size + PEEK_BYTES)[SEAL.size :]
        unpacker = msgpack.Unpacker(raw=False, strict_map_key=False)
        unpacker.feed(head)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack()
            if key in ("journal_seq", "log_end"):
                found[key] = int(unpacker.unpack())
                if len(found) == 2:
                    break
            else:
                unpacker.skip()
    except (OSError, ValueError, TypeError, msgpack.UnpackException, msgpack.OutOfData):
        pass
    return found.get("journal_seq"), found.get("log_end")
