"""Snapshots of the broker's consumption state, so a restart replays only the journal after one.

A snapshot is msgpack with a CRC-32, written to a temporary file, fsynced and renamed over the last
one: a crash leaves the old or the new one whole. A snapshot that fails its CRC is an error naming
the file; the broker does not guess at positions.
"""

from __future__ import annotations

import os
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack

from qmq.store.segment import fsync_dir

FILE_NAME = "consumers.snapshot"
HEADER = struct.Struct(">II")  # crc32 of the body, body length


class SnapshotError(ValueError):
    pass


def load(directory: Path) -> dict[str, Any] | None:
    path = directory / FILE_NAME
    if not path.exists():
        return None
    data = path.read_bytes()
    if len(data) < HEADER.size:
        raise SnapshotError(f"{path}: truncated snapshot ({len(data)} bytes)")
    crc, length = HEADER.unpack_from(data)
    body = data[HEADER.size :]
    if len(body) != length or zlib.crc32(body) != crc:
        raise SnapshotError(f"{path}: snapshot fails its CRC check (expected {length} bytes, have {len(body)})")
    return msgpack.unpackb(body, raw=False, strict_map_key=False)


def save(directory: Path, snapshot: dict[str, Any]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    body = msgpack.packb(snapshot, use_bin_type=True)
    tmp = directory / (FILE_NAME + ".tmp")
    with open(tmp, "wb") as f:
        f.write(HEADER.pack(zlib.crc32(body), len(body)) + body)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / FILE_NAME)
    fsync_dir(directory)
