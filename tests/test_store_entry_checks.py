"""Consume-log and index entries are checked when read (issue 19, case 3): an entry that points at
another record, at no record, or that is not an entry at all, gets its file rebuilt from the message
log (a WARNING says so) and the read goes on: no message skipped, no error for ever."""

from __future__ import annotations

import logging
import struct

import pytest

from qmq.store.consume_log import ENTRY_SIZE
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

COUNT = 300
OFFSET_FIELD = 8  # byte of an entry where its message-log offset starts (consume_log.ENTRY)


def fill(data_dir) -> None:
    with LogStore(data_dir, SMALL) as store:
        for b in range(COUNT // 30):
            store.append_durable([Message("s", f"m-{b * 30 + i}", b"x" * 50, key=f"k{b * 30 + i}") for i in range(30)])


def damage_entry(data_dir, seq: int, how: str) -> None:
    path = data_dir / "consumelog" / "s" / f"{seq - seq % SMALL.consume_segment_entries:020d}"
    at = (seq % SMALL.consume_segment_entries) * ENTRY_SIZE
    with open(path, "r+b") as f:
        f.seek(at)
        entry = bytearray(f.read(ENTRY_SIZE))
        if how == "magic":  # not an entry any more (it used to read as a hole: skipped silently)
            entry[0] ^= 0x5A
        elif how == "other-record":  # points at the record of seq 0
            entry[OFFSET_FIELD : OFFSET_FIELD + 8] = struct.pack(">Q", 0)
        else:  # points into the middle of a record: no record starts there
            offset = struct.unpack_from(">Q", entry, OFFSET_FIELD)[0]
            entry[OFFSET_FIELD : OFFSET_FIELD + 8] = struct.pack(">Q", offset + 3)
        f.seek(at)
        f.write(entry)


@pytest.mark.parametrize("how", ["magic", "other-record", "no-record"])
def test_a_damaged_consume_log_entry_is_rebuilt_when_read(tmp_path, caplog, how) -> None:
    fill(tmp_path)
    damage_entry(tmp_path, 100, how)
    with caplog.at_level(logging.WARNING, logger="qmq.store"), LogStore(tmp_path, SMALL) as store:
        for _round in range(2):  # and again: the file was rebuilt, not patched for one read
            records = store.read("s", 0, 1000, max_scan=1000).records
            assert [r.message_id for r in records] == [f"m-{i}" for i in range(COUNT)]
    assert any("rebuilding the consume log" in r.getMessage() for r in caplog.records), caplog.text


def test_a_damaged_index_entry_is_rebuilt_when_read(tmp_path, caplog) -> None:
    fill(tmp_path)
    with LogStore(tmp_path, SMALL) as store:
        index_file = store.index.files[-1]
        path, entries_at, count = index_file.path, index_file.entries_at, index_file.count
    with open(path, "r+b") as f:  # every entry of the newest file points one byte into its record
        for n in range(count):
            f.seek(entries_at + n * 20 + 8)
            offset = struct.unpack(">Q", f.read(8))[0]
            f.seek(entries_at + n * 20 + 8)
            f.write(struct.pack(">Q", offset + 1))
    with caplog.at_level(logging.WARNING, logger="qmq.store"), LogStore(tmp_path, SMALL) as store:
        last = f"m-{COUNT - 1}"
        assert store.find_by_id(last).message_id == last
        assert [r.message_id for r in store.find_by_key("s", f"k{COUNT - 2}")] == [f"m-{COUNT - 2}"]
    assert any("rebuilding the index" in r.getMessage() for r in caplog.records), caplog.text
