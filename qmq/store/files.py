"""Writing files durably, for the store and every server: above all small files written whole
(checkpoints, snapshots, settings, exports), so that a crash leaves the old version or the new one,
never a mix.

The one way to put such a file in place: write a temporary file beside it, fsync it, rename it over
the old one, fsync the directory (the rename is durable only then). `sealed` / `unsealed` frame a body
with its length and CRC-32, for files whose damage must be told from their absence.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

from qmq.store import checksum

TMP_SUFFIX = ".tmp"
SEAL = struct.Struct(">II")  # crc32 of the body, body length


class DamagedFile(ValueError):
    """A sealed file whose length or CRC does not match its body."""


def tmp_path(path: Path) -> Path:
    """The temporary file that becomes `path`."""
    return path.with_name(path.name + TMP_SUFFIX)


def pwrite_all(fd: int, data: bytes | memoryview, position: int) -> None:
    """Write all of `data` at `position` (a short write is rare, but legal)."""
    written = os.pwrite(fd, data, position)
    while written < len(data):
        written += os.pwrite(fd, memoryview(data)[written:], position + written)


def fsync_dir(directory: Path) -> None:
    """Make a file creation, rename or deletion in `directory` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: Path) -> None:
    """Fsync a file (or directory) by name: fsync flushes the file, whichever descriptor asks. A file
    deleted meanwhile needs nothing."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_durably(tmp: Path, path: Path) -> None:
    """Put the finished file `tmp` in place of `path`: fsync it, rename it, fsync the directory."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` durably and all at once."""
    tmp = tmp_path(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def write_json(path: Path, value: Any, *, indent: int | None = None) -> None:
    """`value` as the JSON file `path`, written atomically (compact unless `indent` is given)."""
    separators = (",", ":") if indent is None else None
    write_atomically(path, json.dumps(value, indent=indent, separators=separators).encode())


def read_json(path: Path) -> Any | None:
    """The JSON value in `path`, or None when there is no such file. Raises ValueError (a JSON error)
    when the file cannot be parsed."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return json.loads(text)


def sealed(body: bytes) -> bytes:
    """`body` framed with its CRC-32 and length."""
    return SEAL.pack(checksum.crc32(body), len(body)) + body


def unsealed(data: bytes, path: Path, what: str = "file") -> bytes:
    """The body of a sealed file's `data`; `DamagedFile` naming `path` (a `what`) if it does not
    check out."""
    if len(data) < SEAL.size:
        raise DamagedFile(f"{path}: truncated {what} ({len(data)} bytes)")
    crc, length = SEAL.unpack_from(data)
    body = data[SEAL.size :]
    if len(body) != length or checksum.crc32(body) != crc:
        raise DamagedFile(f"{path}: {what} fails its CRC check (expected {length} bytes, have {len(body)})")
    return body
