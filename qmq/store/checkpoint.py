"""Checkpoints: how far the derived logs (consume logs, key index) are known complete and durable.

Recovery replays only the message log after the checkpoint. A checkpoint is a JSON file written
atomically (`files.py`), so a crash leaves either the old or the new one whole, and it carries a CRC
of its content, so a flipped bit makes it unreadable (and the derived logs rebuilt) rather than
believed: a wrong `next_seq` would hide acknowledged messages and reuse their sequence numbers.
Version 1 files (before the CRC) are still read; the store cross-checks every checkpoint against
the consume logs anyway (`LogStore._checkpoint_disagrees`).
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qmq.store.files import read_json, write_json

FILE_NAME = "checkpoint.json"
VERSION = 2  # 2: with "crc"; 1: without


@dataclass
class Checkpoint:
    offset: int = 0  # message-log offset: every record before it is in the derived logs
    next_seq: dict[str, int] = field(default_factory=dict)  # per subject
    index: dict | None = None  # KeyIndex.state() at `offset`


class CheckpointError(ValueError):
    """The checkpoint file exists but cannot be read."""


def load(directory: Path) -> Checkpoint | None:
    """The last checkpoint, or None if there is none yet. `CheckpointError` when it is unreadable or
    fails its CRC."""
    path = directory / FILE_NAME
    try:
        data = read_json(path)
        if data is None:
            return None
        version = data.get("version")
        if version not in (1, VERSION):
            raise CheckpointError(f"{path}: checkpoint version {version} is not {VERSION}")
        if version == VERSION and data.get("crc") != _crc(data):
            raise CheckpointError(f"{path}: checkpoint fails its CRC check")
        return Checkpoint(offset=int(data["offset"]), next_seq=dict(data["next_seq"]), index=data.get("index"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


def save(directory: Path, checkpoint: Checkpoint) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"version": VERSION, "offset": checkpoint.offset, "next_seq": checkpoint.next_seq, "index": checkpoint.index}
    data["crc"] = _crc(data)
    write_json(directory / FILE_NAME, data)


def _crc(data: dict[str, Any]) -> int:
    """CRC-32 of the checkpoint's content (everything but "crc"), in a canonical JSON form."""
    content = {k: v for k, v in data.items() if k != "crc"}
    return zlib.crc32(json.dumps(content, sort_keys=True, separators=(",", ":")).encode())
