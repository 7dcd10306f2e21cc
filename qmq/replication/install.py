"""Installing a copy of the master's state over a replica's data directory, for a replica that the
master's retention left behind (delay_server/snapshot.py: the schedule; qmq/broker/state_copy.py:
the consumption state). A marker file says an install is under way: a crash part-way leaves it,
and the next start wipes the directory back to empty (`discard_interrupted`), so a replica never
runs on half a copy; it copies again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path

from qmq.store.files import fsync_dir, fsync_path
from qmq.store.segment import segment_name

log = logging.getLogger("qmq.replication")

INSTALLING = "snapshot.installing"  # marker: the data directory is being replaced by a copy
STORE_DIRS = ("messagelog", "consumelog", "index", "checkpoint")  # the log store's, begun again empty
STORE_FILES = ("recovery_point", "epochs")


@contextlib.contextmanager
def installing(data_dir: Path, what: str, state_dirs: Sequence[str] = ()) -> Iterator[None]:
    """Around an install into the (closed) store of `data_dir`: the marker is written and synced,
    the log store and `state_dirs` are wiped, the body puts the copy in place; if it fails the
    directory is wiped again (empty, never half-installed) and the error raised; the marker goes
    last. Blocking."""
    marker = data_dir / INSTALLING
    marker.write_text(f"installing {what}\n")
    fsync_path(marker)
    fsync_dir(data_dir)
    try:
        wipe(data_dir, state_dirs)
        yield
        fsync_dir(data_dir)
    except BaseException:
        wipe(data_dir, state_dirs)
        raise
    marker.unlink()
    fsync_dir(data_dir)


def start_log_at(data_dir: Path, base: int) -> None:
    """An empty message log whose first segment begins at `base` (as the master's segment there)."""
    (data_dir / "messagelog").mkdir()
    fd = os.open(data_dir / "messagelog" / segment_name(base), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(data_dir / "messagelog")


def discard_interrupted(data_dir: Path, state_dirs: Sequence[str] = ()) -> bool:
    """At start: an install that a crash cut short leaves neither the old state nor the copy
    trustworthy; wipe both (the replica starts empty and copies again). Whether it did."""
    marker = data_dir / INSTALLING
    if not marker.exists():
        return False
    log.warning("%s: a copy of the master's state was being installed; starting empty, to copy it again", data_dir)
    wipe(data_dir, state_dirs)
    marker.unlink()
    fsync_dir(data_dir)
    return True


def wipe(data_dir: Path, state_dirs: Sequence[str] = ()) -> None:
    for part in (*STORE_DIRS, *state_dirs):
        shutil.rmtree(data_dir / part, ignore_errors=True)
    for name in STORE_FILES:
        (data_dir / name).unlink(missing_ok=True)
    fsync_dir(data_dir)
