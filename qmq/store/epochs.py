"""The epoch file of a replicated store: at which message-log offset each master epoch began
(Kafka's leader-epoch cache), so a returning replica or a deposed master can find where its log and
the new master's part (docs/replication.md).

`<data-dir>/epochs`: one line per epoch, `epoch start_offset`, oldest first, written whole through
`files.write_atomically`. A master adds a line when it takes office; a replica copies the master's
lines that begin within what it holds. Nothing else here does I/O.
"""

from __future__ import annotations

from pathlib import Path

from qmq.store.files import write_atomically

FILE_NAME = "epochs"

Epochs = list[tuple[int, int]]  # (epoch, start offset), ascending in both


def parse(text: str) -> Epochs:
    epochs: Epochs = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"{FILE_NAME} line {number}: {line!r} is not 'epoch start_offset'")
        epoch, start = int(parts[0]), int(parts[1])
        if epochs and (epoch <= epochs[-1][0] or start < epochs[-1][1]):
            raise ValueError(f"{FILE_NAME} line {number}: epochs and offsets must grow")
        epochs.append((epoch, start))
    return epochs


def load(data_dir: Path) -> Epochs:
    path = data_dir / FILE_NAME
    return parse(path.read_text()) if path.exists() else []


def save(data_dir: Path, epochs: Epochs) -> None:
    write_atomically(data_dir / FILE_NAME, "".join(f"{e} {s}\n" for e, s in epochs).encode())


def last_epoch(epochs: Epochs) -> int:
    return epochs[-1][0] if epochs else 0


def with_epoch(epochs: Epochs, epoch: int, start: int) -> Epochs:
    """`epochs` with `epoch` beginning at `start` (a new master's line); unchanged if already there."""
    if epochs and epochs[-1][0] >= epoch:
        return epochs
    return [*epochs, (epoch, start)]


def merged(mine: Epochs, masters: Epochs, end: int) -> Epochs:
    """A replica's epochs after copying the master's log up to `end`: the master's lines that begin
    at or before `end` (the replica's log is a prefix of the master's)."""
    return [(e, s) for e, s in masters if s <= end] or mine


def end_of(epochs: Epochs, epoch: int, log_end: int) -> int:
    """Where `epoch` ends in a log with these epochs: the start of the first later epoch, or the
    log's end when `epoch` is the last (Kafka's OffsetsForLeaderEpoch). An epoch older than every
    line ends where the first line begins."""
    for e, start in epochs:
        if e > epoch:
            return start
    return log_end


def truncated(epochs: Epochs, offset: int) -> Epochs:
    """The lines that still begin within a log cut back to `offset`."""
    return [(e, s) for e, s in epochs if s <= offset]
