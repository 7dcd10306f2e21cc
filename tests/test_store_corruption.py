"""Corruption: flipped bytes and truncated files in the active and in sealed segments. A torn tail is
cut (and kept in quarantine/); damage with valid records after it, or in a sealed segment, makes the
store refuse to open, naming file and offset, until repair is asked for; repair keeps every valid record."""

import dataclasses
import os
import subprocess
import sys

import pytest

from qmq.store.rebuild import rebuild_consume_log
from qmq.store.record import RecordError, decode, encode_blank, lost_messages
from qmq.store.recovery import CorruptStoreError
from qmq.store.store import LogStore, Message
from qmq.store.verify import verify
from tests.support.stores import SMALL, payload_for

REPAIR = dataclasses.replace(SMALL, repair=True)
VERIFY_ALL = dataclasses.replace(SMALL, verify_all_on_open=True)


def fill(data_dir, batches=12, per_batch=64):
    """A closed store with several sealed segments; returns {message_id: (offset, size)}."""
    written = {}
    with LogStore(data_dir, SMALL) as store:
        for b in range(batches):
            batch = []
            for i in range(per_batch):
                mid = f"m-{b * per_batch + i:05d}"
                batch.append(Message("s", mid, payload_for(mid)))
            for m, r in zip(batch, store.append_durable(batch), strict=True):
                written[m.message_id] = (r.offset, r.end - r.offset)
    return written


def segment_files(data_dir):
    return sorted((data_dir / "messagelog").iterdir())


def flip(path, position):
    with open(path, "r+b") as f:
        f.seek(position)
        byte = f.read(1)
        f.seek(position)
        f.write(bytes([byte[0] ^ 0xFF]))


def ids_in(store):
    return {r.message_id for r in store.read("s", 0, 100_000, max_scan=100_000).records}


def cli_verify(data_dir):
    return subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(data_dir)], capture_output=True, text=True
    )


def record_in(written, path, which):
    """(message id, offset, size) of the first/middle/last record inside segment file `path`."""
    base = int(path.name)
    inside = sorted((o, s, m) for m, (o, s) in written.items() if base <= o < base + path.stat().st_size)
    o, s, m = inside[{"first": 0, "middle": len(inside) // 2, "last": -1}[which]]
    return m, o, s


def test_torn_tail_of_the_active_segment_is_cut_and_kept(tmp_path):
    written = fill(tmp_path)
    active = segment_files(tmp_path)[-1]
    victim, offset, size = record_in(written, active, "last")
    os.truncate(active, offset - int(active.name) + size // 2)  # the last write only half done
    (tmp_path / "recovery_point").unlink()  # and never fsynced (else it is corruption: test_store_recovery_point)
    with LogStore(tmp_path, SMALL) as store:
        assert store.recovery.truncated_bytes == size // 2
        assert ids_in(store) == set(written) - {victim}
        store.append_durable([Message("s", "after", b"x")])  # appends go on from the cut
        assert store.read("s", store.next_seq("s") - 1).records[0].message_id == "after"
    assert list((tmp_path / "quarantine").iterdir())
    assert verify(tmp_path).ok


def test_garbage_after_the_last_record_is_cut(tmp_path):
    written = fill(tmp_path)
    with open(segment_files(tmp_path)[-1], "ab") as f:
        f.write(b"\x00\x00\x01")
    with LogStore(tmp_path, SMALL) as store:
        assert store.recovery.truncated_bytes == 3
        assert ids_in(store) == set(written)


def test_flipped_byte_in_the_middle_of_the_active_segment_refuses_then_repairs(tmp_path):
    written = fill(tmp_path)
    active = segment_files(tmp_path)[-1]
    victim, offset, size = record_in(written, active, "middle")
    flip(active, offset - int(active.name) + size - 3)  # in the payload
    with pytest.raises(CorruptStoreError) as excinfo:
        LogStore(tmp_path, SMALL)
    assert str(active) in str(excinfo.value) and f"offset {offset}" in str(excinfo.value)
    result = cli_verify(tmp_path)
    assert result.returncode == 1
    assert str(active) in result.stdout and f"offset {offset}" in result.stdout
    with LogStore(tmp_path, REPAIR) as store:
        assert len(store.recovery.repaired) == 1
        assert ids_in(store) == set(written) - {victim}
    with LogStore(tmp_path, SMALL) as store:  # repaired for good
        assert ids_in(store) == set(written) - {victim}
    assert cli_verify(tmp_path).returncode == 0


@pytest.mark.parametrize("where", ["size", "magic", "payload"])
def test_damage_in_a_recent_sealed_segment_refuses_to_open(tmp_path, where):
    written = fill(tmp_path)
    sealed = segment_files(tmp_path)[-2]
    victim, offset, size = record_in(written, sealed, "middle")
    position = offset - int(sealed.name) + {"size": 1, "magic": 5, "payload": size - 1}[where]
    flip(sealed, position)
    with pytest.raises(CorruptStoreError, match=f"offset {offset}"):
        LogStore(tmp_path, SMALL)
    with LogStore(tmp_path, REPAIR) as store:
        assert ids_in(store) == set(written) - {victim}
        assert store.find_by_id(victim) is None
        kept = sorted(written)[0]
        assert store.find_by_id(kept).payload == payload_for(kept)
    assert verify(tmp_path).ok


def test_damage_in_an_old_sealed_segment_is_found_by_verify_and_by_reads(tmp_path):
    written = fill(tmp_path)
    oldest = segment_files(tmp_path)[0]
    victim, offset, size = record_in(written, oldest, "first")
    flip(oldest, offset - int(oldest.name) + size - 1)
    result = cli_verify(tmp_path)
    assert result.returncode == 1 and f"{oldest}: bad record at offset {offset}" in result.stdout
    # only recent segments are checked at open, but a read never returns a damaged record
    with LogStore(tmp_path, SMALL) as store, pytest.raises(RecordError, match=f"offset {offset}.*CRC"):
        store.read_record(offset)
    with pytest.raises(CorruptStoreError, match=str(oldest)):
        LogStore(tmp_path, VERIFY_ALL)
    with LogStore(tmp_path, REPAIR) as store:
        assert ids_in(store) == set(written) - {victim}


def test_truncated_sealed_segment_refuses_then_repairs_keeping_later_segments(tmp_path):
    written = fill(tmp_path)
    sealed = segment_files(tmp_path)[-2]
    victim, offset, _size = record_in(written, sealed, "last")
    os.truncate(sealed, offset - int(sealed.name) + 10)
    with pytest.raises(CorruptStoreError, match=str(sealed)):
        LogStore(tmp_path, SMALL)
    with LogStore(tmp_path, REPAIR) as store:
        assert ids_in(store) == set(written) - {victim}
        assert sealed.stat().st_size + int(sealed.name) == int(segment_files(tmp_path)[-1].name)
    assert verify(tmp_path).ok


def test_damaged_checkpoint_rebuilds_derived_logs(tmp_path):
    written = fill(tmp_path)
    (tmp_path / "checkpoint" / "checkpoint.json").write_text("{not json")
    with LogStore(tmp_path, SMALL) as store:
        assert ids_in(store) == set(written)
        assert store.next_seq("s") == len(written)


def test_damaged_consume_log_is_rebuilt_by_repair(tmp_path):
    written = fill(tmp_path)
    consume = sorted((tmp_path / "consumelog" / "s").iterdir())[1]
    flip(consume, 40)
    assert not verify(tmp_path).ok
    with LogStore(tmp_path, REPAIR) as store:
        assert ids_in(store) == set(written)
    assert verify(tmp_path).ok


def test_damaged_index_file_refuses_then_is_rebuilt_by_repair(tmp_path):
    written = fill(tmp_path)
    index_file = sorted((tmp_path / "index").iterdir())[-1]
    os.truncate(index_file, 0)
    (tmp_path / "index" / "00000000000000999999.tmp").write_bytes(b"half made")  # a crash mid-creation
    with pytest.raises(ValueError, match="repair"):
        LogStore(tmp_path, SMALL)
    with LogStore(tmp_path, REPAIR) as store:
        some = sorted(written)[100]
        assert store.find_by_id(some).message_id == some
    assert not list((tmp_path / "index").glob("*.tmp"))


def test_index_entries_written_past_the_header_count_are_undone(tmp_path):
    """A crash inside a batch of index inserts (entries and bucket heads written, the header's count
    not yet) followed by a torn tail: the buckets must not point past the count, or older entries in
    them become unreachable. Found by the crash test."""
    from qmq.store import checkpoint as ckpt
    from qmq.store import index

    with LogStore(tmp_path, SMALL) as store:
        store.append_durable([Message("s", f"early-{i}", b"x") for i in range(500)])
        store.checkpoint()
        saved = ckpt.load(tmp_path / "checkpoint")
        results = store.append_durable([Message("s", f"late-{i}", b"x") for i in range(200)])
        last = store.index.files[-1]
        index.HEADER.pack_into(
            last.mm, 0, index.FILE_MAGIC, last.slots, last.capacity, last.count - 190, last.last_offset
        )  # the header lags the entries, as after a SIGKILL
    ckpt.save(tmp_path / "checkpoint", saved)
    active = segment_files(tmp_path)[-1]
    os.truncate(active, results[10].offset - int(active.name) + 5)  # and all but 10 late records torn
    (tmp_path / "recovery_point").unlink()  # (torn, so never fsynced: no recovery point covers them)
    with LogStore(tmp_path, SMALL) as store:
        assert [i for i in range(500) if store.find_by_id(f"early-{i}") is None] == []
        assert all(store.find_by_id(f"late-{i}") is not None for i in range(10))
        assert store.find_by_id("late-40") is None


def test_qmq_log_repair_does_what_the_refusal_offers(tmp_path):
    """Issue 19, case 6: the refusal names `qmq log repair`, which exists and repairs for good."""
    written = fill(tmp_path)
    active = segment_files(tmp_path)[-1]
    victim, offset, size = record_in(written, active, "middle")
    flip(active, offset - int(active.name) + size - 3)
    with pytest.raises(CorruptStoreError, match="qmq log repair --data-dir"):
        LogStore(tmp_path, SMALL)
    result = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "repair", "--data-dir", str(tmp_path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert f"offset {offset}" in result.stdout and "1 damaged regions quarantined" in result.stdout
    assert any((tmp_path / "quarantine").iterdir())
    assert cli_verify(tmp_path).returncode == 0
    with LogStore(tmp_path, SMALL) as store:
        assert ids_in(store) == set(written) - {victim}


def test_qmq_log_repair_refuses_a_store_in_use(tmp_path):
    fill(tmp_path)
    with LogStore(tmp_path, SMALL):
        result = subprocess.run(
            [sys.executable, "-m", "qmq", "log", "repair", "--data-dir", str(tmp_path)], capture_output=True, text=True
        )
    assert result.returncode == 1 and "in use by another process" in result.stderr


def test_a_message_cut_out_as_lost_keeps_its_sequence_in_every_consume_log_derived_later(tmp_path):
    """A region given up as lost (no group member had a good copy) is covered by a blank record that
    names the messages it replaced: a consume log rebuilt from the message log, or derived by a
    replica, points their sequences at the blank, so readers dead-letter them instead of passing a
    hole; `qmq log repair`'s blanks, which cannot know them, name none."""
    written = fill(tmp_path)
    oldest = segment_files(tmp_path)[0]
    victim, offset, size = record_in(written, oldest, "middle")
    flip(oldest, offset - int(oldest.name) + size - 1)
    seq = int(victim.removeprefix("m-"))
    with LogStore(tmp_path, SMALL) as store:
        store.note_damage(offset, "a replica's CRC check")
        store.lose(offset, "no member has a good copy")
        blank = store.read_record(offset)
        assert blank.is_blank and blank.size == size and lost_messages(blank) == [("s", seq)]
        rebuilt = rebuild_consume_log(store.message_log, tmp_path / "rebuilt", "s", 1024)
        [entry] = rebuilt.read(seq, 1)
        assert (entry.offset, entry.size) == (offset, size)
        assert rebuilt.end_seq() == len(written)
        rebuilt.close()
        assert ids_in(store) == set(written) - {victim}
        assert ("s", seq) in store.unreadable  # reported: the broker dead-letters it
    assert lost_messages(decode(encode_blank(size), 0, 0)) == []
