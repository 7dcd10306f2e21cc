"""The durable recovery point (issue 19, cases 5 and 6): damage to the last record of the active
segment is cut as a torn tail only past the offset known fsynced; before it, the store refuses to
open, naming `qmq log repair`, which quarantines the damage, rebuilds the derived files and says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qmq.store.recovery import CorruptStoreError
from qmq.store.recovery_point import RecoveryPoint
from qmq.store.store import LogStore, Message
from qmq.store.verify import verify
from tests.support.stores import SMALL

COUNT = 200


def fill(data_dir) -> list[tuple[int, int]]:
    with LogStore(data_dir, SMALL) as store:
        return [
            (a.offset, a.end) for a in store.append_durable([Message("s", f"m-{i}", b"x" * 60) for i in range(COUNT)])
        ]


def active_segment(data_dir):
    return sorted((data_dir / "messagelog").iterdir())[-1]


def qmq_log(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "qmq", "log", *args], capture_output=True, text=True)


@pytest.mark.parametrize("damage", ["flipped", "cut-short"])
def test_damage_to_an_fsynced_last_record_refuses_and_repair_fixes_it(tmp_path, damage) -> None:
    written = fill(tmp_path)
    last_offset, last_end = written[-1]
    assert RecoveryPoint(tmp_path).load() == last_end, "the flusher recorded the durable point"
    active = active_segment(tmp_path)
    at = last_offset - int(active.name)
    if damage == "flipped":
        with open(active, "r+b") as f:
            f.seek(at + 40)
            byte = f.read(1)
            f.seek(at + 40)
            f.write(bytes([byte[0] ^ 0xFF]))
    else:
        os.truncate(active, at + (last_end - last_offset) // 2 + 20)
    with pytest.raises(CorruptStoreError) as refused:
        LogStore(tmp_path, SMALL)
    assert "qmq log repair --data-dir" in str(refused.value)
    assert "qmq broker --repair" not in str(refused.value)
    repaired = qmq_log("repair", "--data-dir", str(tmp_path))
    assert repaired.returncode == 0, repaired.stdout + repaired.stderr
    assert "quarantined" in repaired.stdout and "verify after repair: OK" in repaired.stdout, repaired.stdout
    assert list((tmp_path / "quarantine").iterdir())
    with LogStore(tmp_path, SMALL) as store:
        ids = [r.message_id for r in store.read("s", 0, 1000, max_scan=1000).records]
        assert ids == [f"m-{i}" for i in range(COUNT - 1)]  # every valid record kept
        store.append_durable([Message("s", "after", b"y")])
    assert verify(tmp_path).ok


def test_a_torn_tail_past_the_recovery_point_is_still_cut(tmp_path) -> None:
    fill(tmp_path)
    active = active_segment(tmp_path)
    with open(active, "ab") as f:  # a write the kill interrupted, after the last fsync
        f.write(b"\x00\x00\x01\x00" + b"z" * 30)
    with LogStore(tmp_path, SMALL) as store:
        assert store.recovery.truncated_bytes == 34
        assert store.next_seq("s") == COUNT
