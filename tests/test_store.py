"""The log store: appends, reads by subject and sequence, tags, look-ups, segments, checkpoints,
retention and bad input. Real files in a temporary directory."""

import itertools
import os
import time

import pytest

from qmq.protocol.errors import ProtocolError
from qmq.store import checkpoint as ckpt
from qmq.store.flush import FlushMode
from qmq.store.store import LogStore, Message, StoreError
from qmq.store.verify import verify
from tests.support.stores import SMALL, payload_for


def msg(subject, i, **kw):
    mid = f"{subject}-{i:06d}"
    return Message(subject, mid, payload_for(mid), **kw)


def test_append_read_round_trip(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        results = store.append_durable([msg("orders", i, key=f"k{i % 3}") for i in range(10)])
        assert [r.seq for r in results] == list(range(10))
        assert store.flusher.durable_offset >= results[-1].end
        got = store.read("orders", 0, 100)
        assert [r.message_id for r in got.records] == [f"orders-{i:06d}" for i in range(10)]
        assert all(r.payload == payload_for(r.message_id) for r in got.records)
        assert got.next_seq == 10
        assert store.read("orders", 4, 3).records[0].seq == 4
        assert store.read("nothing", 0).records == []


def test_subjects_have_their_own_sequences(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        store.append([msg("a", 0), msg("b", 0), msg("a", 1), msg("c", 0), msg("a", 2)])
        assert store.subjects() == {"a": 3, "b": 1, "c": 1}
        assert [r.seq for r in store.read("a", 0).records] == [0, 1, 2]


def test_segments_roll_and_records_never_span_two(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        for batch in range(40):
            store.append([msg("s", batch * 64 + i) for i in range(64)])
        segments = store.message_log.segments
        assert len(segments) > 10
        for seg, following in itertools.pairwise(segments):
            assert seg.end == following.base
            assert seg.size <= SMALL.segment_bytes
            assert seg.path.name == f"{seg.base:020d}"
        assert len(store.read("s", 0, 10_000, max_scan=10_000).records) == 40 * 64
    assert verify(tmp_path).ok


def test_tag_filter_any_and_all(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        store.append(
            [
                msg("t", 0, tags=("red",)),
                msg("t", 1, tags=("red", "big")),
                msg("t", 2, tags=("blue",)),
                msg("t", 3),
                msg("t", 4, tags=("big",)),
            ]
        )
        seqs = lambda **kw: [r.seq for r in store.read("t", 0, 10, **kw).records]  # noqa: E731
        assert seqs(tags=["red"]) == [0, 1]
        assert seqs(tags=["red", "blue"]) == [0, 1, 2]
        assert seqs(tags=["red", "big"], match_all=True) == [1]
        assert seqs(tags=["green"]) == []


def test_find_by_id_and_key_across_index_files(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        for batch in range(30):  # 3,000+ index entries: the 1,024-entry index file rolls
            store.append([msg("k", batch * 50 + i, key=f"user-{i % 7}") for i in range(50)])
        assert len(store.index.files) > 2
        record = store.find_by_id("k-000777")
        assert record is not None and record.seq == 777
        assert store.find_by_id("k-999999") is None
        hits = store.find_by_key("k", "user-3")
        assert len(hits) == len([i for i in range(1500) if i % 50 % 7 == 3])
        assert all(r.key == "user-3" for r in hits)
        assert store.find_by_key("other", "user-3") == []


def test_reopen_after_clean_close_replays_nothing(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        store.append([msg("a", i) for i in range(100)])
    with LogStore(tmp_path, SMALL) as store:
        assert store.recovery.replayed == 0
        assert store.next_seq("a") == 100
        store.append([msg("a", 100)])
        assert store.read("a", 100).records[0].message_id == "a-000100"


def test_recovery_replays_only_after_the_checkpoint(tmp_path):
    store = LogStore(tmp_path, SMALL)
    store.append([msg("a", i) for i in range(100)])
    store.checkpoint()
    saved = ckpt.load(tmp_path / "checkpoint")
    store.append([msg("a", i) for i in range(100, 130)])
    store.flusher.wait_durable(store.message_log.end_offset)
    # a crash: derived logs after the checkpoint are lost (simulate by cutting the consume log)
    store.close()
    ckpt.save(tmp_path / "checkpoint", saved)
    cl = tmp_path / "consumelog" / "a"
    for p in sorted(cl.iterdir())[-1:]:
        os.truncate(p, 0)
    with LogStore(tmp_path, SMALL) as store:
        assert store.recovery.replayed == 30
        assert store.recovery.scanned_from <= saved.offset
        assert [r.seq for r in store.read("a", 0, 1000, max_scan=1000).records] == list(range(130))
        assert store.find_by_id("a-000120").seq == 120
    assert verify(tmp_path).ok


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        store.append([msg("ok", 0)])
        with pytest.raises(ProtocolError, match="subject"):
            store.append([msg("ok", 1), Message("bad subject!", "x", b"")])
        with pytest.raises(StoreError, match="message id"):
            store.append([msg("ok", 1), Message("ok", "", b"")])
        with pytest.raises(StoreError, match="key"):
            store.append([Message("ok", "x", b"", key="k" * 1000)])
        with pytest.raises(ProtocolError, match="tag"):
            store.append([Message("ok", "x", b"", tags=("no spaces",))])
        with pytest.raises(StoreError, match="bad message"):
            store.append([Message("ok", "x", "not bytes")])
        assert store.subjects() == {"ok": 1}
        store.append([msg("ok", 1)])
        assert [r.seq for r in store.read("ok", 0).records] == [0, 1]


def test_a_store_directory_opens_once(tmp_path):
    with LogStore(tmp_path, SMALL), pytest.raises(StoreError, match="in use by another process"):
        LogStore(tmp_path, SMALL)


def test_async_flush_acknowledges_at_once_and_flushes_within_the_interval(tmp_path):
    config = SMALL.__class__(**{**SMALL.__dict__, "flush": FlushMode.ASYNC, "flush_interval_ms": 20})
    with LogStore(tmp_path, config) as store:
        results = store.append_durable([msg("a", i) for i in range(10)])
        store.flusher.wait_durable(results[-1].end, timeout=5)
        assert store.flusher.durable_offset >= results[-1].end


def test_group_commit_covers_concurrent_writers_with_fewer_fsyncs(tmp_path):
    import threading

    with LogStore(tmp_path, SMALL) as store:

        def writer(t):
            for j in range(50):
                store.append_durable([msg(f"w{t}", j)])

        threads = [threading.Thread(target=writer, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(store.subjects().values()) == 400
        assert store.flusher.syncs < 400  # one fsync served several writers


def test_retention_deletes_old_segments_and_their_derived_entries(tmp_path):
    with LogStore(tmp_path, SMALL) as store:
        for batch in range(20):
            store.append([msg("r", batch * 64 + i, key="same") for i in range(64)])
        old = store.message_log.segments[:-3]
        past = time.time() - SMALL.retention_s - 3600
        for seg in old:
            os.utime(seg.path, (past, past))
        removed = store.clean()
        assert removed == len(old)
        start = store.message_log.start_offset
        assert start == old[-1].end
        assert not any(seg.path.exists() for seg in old)
        records = store.read("r", 0, 5000, max_scan=5000).records
        assert records and all(r.offset >= start for r in records)
        assert records[-1].seq == 20 * 64 - 1
        assert store.first_seq("r") > 0
        assert all(r.offset >= start for r in store.find_by_key("r", "same"))
        assert store.find_by_id("r-000000") is None
    with LogStore(tmp_path, SMALL) as store:
        assert store.next_seq("r") == 20 * 64
    assert verify(tmp_path).ok


def test_durable_can_be_awaited_from_asyncio(tmp_path):
    import asyncio

    async def main():
        with LogStore(tmp_path, SMALL) as store:
            results = await asyncio.gather(*[asyncio.to_thread(store.append, [msg("x", i)]) for i in range(20)])
            await asyncio.gather(*[store.durable(r[0].end) for r in results])
            return store.flusher.durable_offset >= max(r[0].end for r in results)

    assert asyncio.run(main())


def test_similar_keys_spread_over_the_index_buckets(tmp_path):
    """Look-ups stay bounded only if ids that differ in a digit land in different buckets."""
    from qmq.store import record as rec
    from qmq.store.index import KeyIndex

    index = KeyIndex(tmp_path, slots=256, capacity=8192)
    ids = [f"01JDX7Q3ZP4Y8N2K5M{i:08d}".encode() for i in range(4096)]
    index.add([(rec.key_hash(mid), i) for i, mid in enumerate(ids)])
    f = index.files[0]
    chains = []
    for slot in range(f.slots):
        number = int.from_bytes(f.mm[64 + slot * 4 : 68 + slot * 4], "big")
        length = 0
        while number:
            length += 1
            number = int.from_bytes(f.mm[f.entries_at + (number - 1) * 20 + 16 : f.entries_at + number * 20], "big")
        chains.append(length)
    assert sum(chains) == 4096
    assert max(chains) <= 3 * 4096 // 256  # average 16
    assert all(index.find(rec.key_hash(mid)) == [i] for i, mid in enumerate(ids[:200]))
    index.close()


def test_reserve_written_fills_holes_and_fallocated_ranges_with_zeros_and_keeps_data(tmp_path) -> None:
    """The key index's pages are written before they are mapped (disk_space.reserve_written): no page
    of the range is left as a hole or an allocated-but-unwritten extent, and what was there stays."""
    from qmq.store.disk_space import reserve_written

    size = 8 << 20
    with open(tmp_path / "sparse", "w+b") as f:
        fd = f.fileno()
        os.ftruncate(fd, size)
        os.pwrite(fd, b"kept", 3 << 20)
        os.posix_fallocate(fd, 5 << 20, 1 << 20)
        reserve_written(fd, 1 << 20, size - (1 << 20))
        data = os.pread(fd, size, 0)
        assert data[3 << 20 : (3 << 20) + 4] == b"kept" and data.count(0) == size - 4
        assert os.lseek(fd, 0, os.SEEK_DATA) == 1 << 20  # before the range: still a hole
        assert os.lseek(fd, 1 << 20, os.SEEK_HOLE) == size  # the range: data all through


def test_a_new_store_makes_its_first_index_file_with_its_slots_written_before_any_send(tmp_path) -> None:
    """The first send must not wait for the key index's slots: the file exists at open, named by the
    offset the log writes next, with every slot written (no hole), and the first append goes into it."""
    with LogStore(tmp_path, SMALL) as store:
        assert len(store.index.files) == 1
        first = store.index.files[0]
        assert first.base == store.message_log.end_offset
        assert os.lseek(first.fd, 0, os.SEEK_HOLE) >= first.entries_at  # the slots: data all through
        store.append_durable([msg("a", 0)])
        assert store.index.files == [first] and first.count == 1
    with LogStore(tmp_path, SMALL) as store:  # reopened: the same file, nothing made again
        assert [f.base for f in store.index.files] == [first.base]
        assert store.find_by_id("a-000000").seq == 0


def test_a_checkpoint_syncs_the_directories_that_new_consume_log_files_went_into(tmp_path) -> None:
    """New consume-log files are not made durable on the send path (their directory's fsync waits for
    the disk): the next checkpoint syncs their directories with their entries, and after an open the
    first one syncs the directories it found."""
    from qmq.store.consume_log import ConsumeLog, pack_entry
    from qmq.store.segment import segment_name

    consume_log = ConsumeLog(tmp_path / "consumelog" / "s", entries_per_segment=4)
    consume_log.write(0, pack_entry(0, 10, 0, 0))
    consume_log.write(4, pack_entry(10, 10, 0, 0))  # a second segment

    def synced() -> set[tuple[int, int]]:
        fds = consume_log.take_dirty_fds()
        try:
            return {(os.fstat(fd).st_dev, os.fstat(fd).st_ino) for fd in fds}
        finally:
            for fd in fds:
                os.close(fd)

    def ino(path) -> tuple[int, int]:
        return (path.stat().st_dev, path.stat().st_ino)

    segments = {ino(p) for p in (tmp_path / "consumelog" / "s").iterdir()}
    made = {ino(tmp_path), ino(tmp_path / "consumelog"), ino(tmp_path / "consumelog" / "s")}  # dirs with new entries
    assert synced() == segments | made
    consume_log.write(1, pack_entry(20, 10, 0, 0))  # an existing segment: only itself
    assert synced() == {ino(tmp_path / "consumelog" / "s" / segment_name(0))}
    consume_log.close()
    # Opened again (after a kill, say): what the last process made is visible but perhaps not durable,
    # so the first checkpoint syncs the directories once more.
    consume_log = ConsumeLog(tmp_path / "consumelog" / "s", entries_per_segment=4)
    consume_log.write(2, pack_entry(30, 10, 0, 0))
    assert synced() == {ino(tmp_path / "consumelog" / "s" / segment_name(0))} | made - {ino(tmp_path)}
    consume_log.close()
