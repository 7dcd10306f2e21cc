"""Store replication without a network (qmq/store/replication.py, epochs.py, LogStore.read_chunk and
append_replicated): a replica built from the master's chunks is byte for byte the master's log, its
derived files its own; bad chunks are refused whole; a log cut back keeps what it cut."""

from __future__ import annotations

import errno

import pytest

from qmq.store import epochs as ep
from qmq.store import record as rec
from qmq.store.consume_log import pack_entry
from qmq.store.recovery_point import RecoveryPoint
from qmq.store.replication import ChunkError, check_chunk, split_chunk, truncate_log, whole_prefix
from qmq.store.segment import Segment
from qmq.store.store import LogStore, Message, StoreError
from qmq.store.verify import verify
from tests.support.stores import FLUSHERS, SMALL, payload_for, use_flusher


def fill(store: LogStore, count: int, subject: str = "s", start: int = 0) -> None:
    for i in range(start, start + count, 10):
        ids = [f"{subject}-{j}" for j in range(i, min(i + 10, start + count))]
        store.append_durable([Message(subject, m, payload_for(m), key=m[-2:]) for m in ids])


def copy(master: LogStore, replica: LogStore, max_bytes: int) -> int:
    chunks = 0
    while replica.end_offset < master.end_offset:
        data = master.read_chunk(replica.end_offset, max_bytes)
        replica.append_replicated(data, replica.end_offset)
        chunks += 1
    return chunks


def segment_bytes(store: LogStore) -> bytes:
    return store.read_bytes(store.start_offset, store.end_offset)


def test_a_replica_copied_in_chunks_is_the_masters_log_byte_for_byte(tmp_path) -> None:
    with LogStore(tmp_path / "m", SMALL) as master, LogStore(tmp_path / "r", SMALL) as replica:
        fill(master, 500, "a")
        fill(master, 300, "b")
        assert copy(master, replica, 3000) > 10  # many chunks, across segment rolls
        assert segment_bytes(replica) == segment_bytes(master)
        assert [s.base for s in replica.message_log.segments] == [s.base for s in master.message_log.segments]
        assert replica.subjects() == master.subjects()  # derived: consume logs rebuilt, not copied
        assert [r.message_id for r in replica.read("b", 0, 300).records] == [f"b-{i}" for i in range(300)]
        assert replica.find_by_id("a-42").payload == payload_for("a-42")
        assert [r.message_id for r in replica.find_by_key("a", "42")][-1] == "a-42"
        fill(master, 20, "a", start=500)  # and it goes on from there
        copy(master, replica, 1 << 20)
        assert segment_bytes(replica) == segment_bytes(master)
    for directory in ("m", "r"):
        report = verify(tmp_path / directory)
        assert report.ok, report


def test_chunks_hold_whole_records_even_when_one_is_bigger_than_asked(tmp_path) -> None:
    with LogStore(tmp_path / "m", SMALL) as master:
        master.append_durable([Message("s", "big", b"x" * 5000), Message("s", "small", b"y")])
        chunk = master.read_chunk(0, 100)  # less than the first record: the whole first record anyway
        assert whole_prefix(chunk) == len(chunk) and len(chunk) > 5000
        assert [r.message_id for r in split_chunk(chunk, 0)[1]] == ["big"]
        assert master.read_chunk(master.end_offset, 100) == b""


def test_partial_or_corrupt_chunks_are_refused_whole(tmp_path) -> None:
    with LogStore(tmp_path / "m", SMALL) as master, LogStore(tmp_path / "r", SMALL) as replica:
        fill(master, 20)
        chunk = master.read_chunk(0, 1 << 20)
        with pytest.raises(ChunkError):
            replica.append_replicated(chunk[:-3], 0)  # the last record cut short
        damaged = bytearray(chunk)
        damaged[len(chunk) // 2] ^= 0xFF
        with pytest.raises(ChunkError):
            replica.append_replicated(bytes(damaged), 0)
        assert replica.end_offset == 0 and replica.subjects() == {}  # nothing of either was written
        with pytest.raises(StoreError):
            replica.append_replicated(chunk, 7)  # not where this log ends
        replica.append_replicated(chunk, 0)
        assert replica.end_offset == master.end_offset


@pytest.mark.parametrize("flusher", FLUSHERS)
def test_a_chunk_appended_with_sync_now_is_durable_on_return_without_the_flusher_thread(
    tmp_path, monkeypatch, flusher
) -> None:
    use_flusher(flusher, monkeypatch)
    with LogStore(tmp_path / "m", SMALL) as master, LogStore(tmp_path / "r", SMALL) as replica:
        fill(master, 300)  # across segment rolls: every segment written is synced
        rounds = replica.flusher.syncs
        while replica.end_offset < master.end_offset:
            end = replica.append_replicated(
                master.read_chunk(replica.end_offset, 3000), replica.end_offset, sync_now=True
            )
            assert replica.durable_offset == end == replica.end_offset  # durable on return, nobody asked the thread
        chunks = replica.flusher.syncs_here
        assert chunks > 5 and replica.flusher.syncs == rounds + chunks  # the flusher thread ran no round of its own
        assert segment_bytes(replica) == segment_bytes(master)
        assert [r.message_id for r in replica.read("s", 0, 300).records] == [f"s-{i}" for i in range(300)]
    assert verify(tmp_path / "r").ok


@pytest.mark.parametrize("flusher", FLUSHERS)
def test_a_failed_fsync_of_sync_now_turns_the_replica_read_only(tmp_path, monkeypatch, flusher) -> None:
    use_flusher(flusher, monkeypatch)
    with LogStore(tmp_path / "m", SMALL) as master, LogStore(tmp_path / "r", SMALL) as replica:
        fill(master, 40)
        first = master.read_chunk(0, 2000)
        replica.append_replicated(first, 0, sync_now=True)
        durable = replica.durable_offset

        def failing_sync(segment) -> None:
            raise OSError(errno.EIO, "injected: EIO on fdatasync")

        if flusher == "python":
            monkeypatch.setattr(Segment, "sync", failing_sync)
        else:
            replica.flusher._native.fail_next(errno.EIO)
        with pytest.raises(StoreError, match=r"read-only.*EIO"):
            replica.append_replicated(master.read_chunk(durable, 2000), durable, sync_now=True)
        assert replica.durable_offset == durable  # nothing past the failed fsync is said durable
        monkeypatch.undo()
        with pytest.raises(StoreError, match="read-only"):  # nor taken any more: the page cache may have lost it
            replica.append_replicated(master.read_chunk(replica.end_offset, 2000), replica.end_offset)
        replica.flusher.request(replica.end_offset)  # a later fsync would succeed: none may run
    # Closing ran the flusher's last round: it must not have fsynced and recorded the chunk whose fsync
    # failed as durable (reopened, a damaged tail below the recovery point is refused, not cut).
    assert RecoveryPoint(tmp_path / "r").load() == durable


def test_truncate_keeps_the_cut_bytes_and_the_store_rebuilds_its_derived_files(tmp_path) -> None:
    with LogStore(tmp_path / "m", SMALL) as master:
        fill(master, 400)
        cut_at = next(r for r in master.scan(0) if r.message_id == "s-300").offset
        end = master.end_offset
        tail = master.read_bytes(cut_at, end)
    assert truncate_log(tmp_path / "m", cut_at) == end - cut_at
    kept = b"".join(p.read_bytes() for p in sorted((tmp_path / "m" / "quarantine").iterdir()))
    assert kept == tail
    assert RecoveryPoint(tmp_path / "m").load() == cut_at  # what was cut is not "durable bytes missing"
    with LogStore(tmp_path / "m", SMALL) as store:
        assert store.end_offset == cut_at
        assert store.next_seq("s") == 300
        assert store.find_by_id("s-350") is None and store.find_by_id("s-299") is not None
        fill(store, 10, start=1000)
        assert store.read("s", 300, 10).records[0].message_id == "s-1000"
    assert verify(tmp_path / "m").ok


def test_epochs_say_where_each_epoch_ends(tmp_path) -> None:
    assert ep.load(tmp_path) == []
    epochs = ep.with_epoch([], 1, 0)
    epochs = ep.with_epoch(epochs, 3, 500)
    assert ep.with_epoch(epochs, 2, 700) == epochs  # never backwards
    ep.save(tmp_path, epochs)
    assert ep.load(tmp_path) == [(1, 0), (3, 500)]
    assert ep.end_of(epochs, 1, 900) == 500
    assert ep.end_of(epochs, 2, 900) == 500  # an epoch this log never had ends where the next began
    assert ep.end_of(epochs, 3, 900) == 900
    assert ep.truncated(epochs, 499) == [(1, 0)]
    assert ep.merged([(1, 0)], [(1, 0), (3, 500), (4, 800)], 600) == [(1, 0), (3, 500)]
    (tmp_path / ep.FILE_NAME).write_text("3 500\n1 0\n")
    with pytest.raises(ValueError):
        ep.load(tmp_path)


def test_a_whole_log_in_one_chunk_rolls_at_the_masters_records_and_derives_what_records_do(tmp_path) -> None:
    with LogStore(tmp_path / "m", SMALL) as master, LogStore(tmp_path / "r", SMALL) as replica:
        for i in range(0, 300, 10):  # two subjects interleaved, with keys and tags
            master.append_durable(
                [
                    Message("ab"[j % 2], f"m-{j}", payload_for(f"m-{j}"), key=f"k{j % 7}", tags=["t1", f"t{j % 3}"])
                    for j in range(i, i + 10)
                ]
            )
        assert len(master.message_log.segments) >= 3  # rolled twice
        chunk = master.read_chunk(0, 1 << 22)
        assert len(chunk) == master.end_offset
        checked = check_chunk(chunk, 0)
        _pieces, records = split_chunk(chunk, 0)
        assert checked.sizes == [r.size for r in records]
        expected_pairs = []
        for r in records:
            expected_pairs.append((rec.key_hash(r.message_id.encode()), r.offset))
            expected_pairs.append((rec.key_hash(r.key.encode(), r.subject.encode()), r.offset))
        assert checked.index_pairs == expected_pairs
        entries: dict[bytes, bytes] = {}
        for r in records:
            entry = pack_entry(r.offset, r.size, rec.tag_mask(r.tags), r.store_ts)
            entries[r.subject.encode()] = entries.get(r.subject.encode(), b"") + entry
        assert {subject: (first, data) for subject, first, data in checked.runs} == {
            subject: (0, data) for subject, data in entries.items()
        }
        replica.append_replicated(chunk, 0)  # one write, rolled where the master rolled
        assert segment_bytes(replica) == segment_bytes(master)
        assert [s.base for s in replica.message_log.segments] == [s.base for s in master.message_log.segments]
        assert replica.next_seq("a") == master.next_seq("a") == 150
        assert [r.message_id for r in replica.read("b", 140, 10, tags=["t1", "t2"], match_all=True).records] == [
            f"m-{j}" for j in range(281, 300, 2) if j % 3 == 2
        ]
        by_key = [r.message_id for r in master.find_by_key("a", "k3")]
        assert by_key and [r.message_id for r in replica.find_by_key("a", "k3")] == by_key


def test_blank_records_are_copied_and_derive_nothing() -> None:
    blank = rec.encode_blank(100)
    message = rec.encode(rec.Attr.MESSAGE, 0, 1, 0, b"s", b"id", b"", b"", b"x")
    checked = check_chunk(blank + message, 1000)
    assert checked.sizes == [100, len(message)]
    assert checked.index_pairs == [(rec.key_hash(b"id"), 1100)]
    assert [(subject, first) for subject, first, _ in checked.runs] == [(b"s", 0)]
    damaged = bytearray(blank + message)
    damaged[-1] ^= 1
    with pytest.raises(ChunkError) as caught:
        check_chunk(bytes(damaged), 1000)
    assert caught.value.offset == 1100
