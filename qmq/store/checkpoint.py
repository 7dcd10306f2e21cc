"""Checkpoints: how far the derived logs (consume logs, key index) are known complete and durable.

Recovery replays only the message log after the checkpoint. A checkpoint is a JSON file written
atomically (`files.py`), so a crash leaves either the old or the new one whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qmq.store.files import read_json, write_json

FILE_NAME = "checkpoint.json"
VERSION = 1


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
        if data.get("version") != VERSION:
            raise CheckpointError(f"{path}: checkpoint version {data.get('version')} is not {VERSION}")
        return Checkpoint(offset=int(data["offset"]), next_seq=dict(data["next_seq"]), index=data.get("index"))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from exc


def save(directory: Path, checkpoint: Checkpoint) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    write_json(
        directory / FILE_NAME,
        {"version": VERSION, "offset": checkpoint.offset, "next_seq": checkpoint.next_seq, "index": checkpoint.index},
    )
