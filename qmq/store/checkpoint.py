"""Checkpoints: how far the derived logs (consume logs, key index) are known complete and durable.

Recovery replays only the message log after the checkpoint. A checkpoint is a JSON file written
atomically (`files.py`), so a crash leaves either the old or the new one whole. Since version 2 it
carries the CRC-32 of its other fields ("crc"), so a flipped digit is found, not believed; the store
also cross-checks it against the logs at open (`cross_check.py`) and rebuilds from the message log
when either check fails. Version 1 files (no CRC) are still read, and only cross-checked.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from qmq.store import checksum
from qmq.store.files import read_json, write_json

FILE_NAME = "checkpoint.json"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: without a CRC


@dataclass
class Checkpoint:
    offset: int = 0  # message-log offset: every record before it is in the derived logs
    next_seq: dict[str, int] = field(default_factory=dict)  # per subject
    index: dict | None = None  # KeyIndex.state() at `offset`


class CheckpointError(ValueError):
    """The checkpoint file exists but cannot be read."""


def load(directory: Path) -> Checkpoint | None:
    """The last checkpoint, or None if there is none yet."""
    path = directory / FILE_NAME
    try:
        data = read_json(path)
        if data is None:
            return None
        if data.get("version") not in READABLE_VERSIONS:
            raise CheckpointError(f"{path}: checkpoint version {data.get('version')} is not {VERSION}")
        if data["version"] >= 2:
            crc = data.pop("crc", None)
            if crc != _crc(data):
                raise CheckpointError(f"{path}: checkpoint fails its CRC check")
        return Checkpoint(offset=int(data["offset"]), next_seq=dict(data["next_seq"]), index=data.get("index"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


def save(directory: Path, checkpoint: Checkpoint) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    data = {"version": VERSION, "offset": checkpoint.offset, "next_seq": checkpoint.next_seq, "index": checkpoint.index}
    write_json(directory / FILE_NAME, {**data, "crc": _crc(data)})


def _crc(data: dict) -> int:
    """CRC-32 of the fields in a canonical form (sorted keys, compact), whatever order they came in."""
    return checksum.crc32(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
