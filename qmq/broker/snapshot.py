"""Snapshots of the broker's consumption state, so a restart replays only the journal after one.

A snapshot is msgpack sealed with its length and CRC-32, written atomically (`qmq.store.files`): a
crash leaves the old or the new one whole. A snapshot that fails its CRC is an error naming the file;
the broker does not guess at positions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack

from qmq.store.files import DamagedFile, sealed, unsealed, write_atomically

FILE_NAME = "consumers.snapshot"


class SnapshotError(ValueError):
    pass


def load(directory: Path) -> dict[str, Any] | None:
    path = directory / FILE_NAME
    if not path.exists():
        return None
    try:
        body = unsealed(path.read_bytes(), path, "snapshot")
    except DamagedFile as exc:
        raise SnapshotError(str(exc)) from None
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def save(directory: Path, snapshot: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_atomically(directory / FILE_NAME, sealed(msgpack.packb(snapshot, use_bin_type=True)))
