"""Races of the flusher (qmq/store/flush.py), each interleaving forced:

- a loop's first wait for durability while another thread's fsync round ends: the round finishes
  after the wait saw its offset not durable and before the loop was registered to be woken, so it
  wakes nobody there; the wait must still return, not hang until some unrelated write comes;
- an fsync that fails on the flusher thread while a caller's `sync_now` comes before that round has
  recorded its end: no second fsync may run and say the bytes durable (fsyncgate: after a failure,
  a later fsync's success says nothing of the pages the kernel dropped)."""

from __future__ import annotations

import asyncio
import errno
import threading
from pathlib import Path

import pytest

from qmq.store.flush import FlushFailed
from qmq.store.recovery_point import RecoveryPoint
from qmq.store.segment import Segment
from qmq.store.store import LogStore, Message
from tests.support.stores import FLUSHERS, SMALL, use_flusher

WAIT_LIMIT_S = 10.0


class RoundDuringRegistration(dict):
    """The flusher's map of loops to wake: its first look-up lets another thread's blocking wait run
    a whole fsync round (`wait_durable`) that covers the offset the loop is about to wait for."""

    def __init__(self, flusher, offset: int) -> None:
        super().__init__()
        self.flusher, self.offset, self.rounds = flusher, offset, 0

    def get(self, key, default=None):
        if not self.rounds:
            self.rounds += 1
            other = threading.Thread(target=self.flusher.wait_durable, args=(self.offset,))
            other.start()
            other.join()
        return super().get(key, default)


@pytest.mark.parametrize("flusher", FLUSHERS)
def test_a_first_wait_covered_by_a_round_that_ended_meanwhile_returns(tmp_path, monkeypatch, flusher) -> None:
    use_flusher(flusher, monkeypatch)
    with LogStore(tmp_path / "store", SMALL) as store:
        flusher = store.flusher
        [appended] = store.append([Message("orders", "m1", b"x")])
        flusher._loops = RoundDuringRegistration(flusher, appended.end)

        async def scenario() -> None:
            await asyncio.wait_for(store.durable(appended.end), WAIT_LIMIT_S)

        asyncio.run(scenario())
        assert flusher._loops.rounds == 1 and store.durable_offset >= appended.end


def test_no_fsync_runs_after_one_failed_even_before_its_round_finished(tmp_path, monkeypatch) -> None:
    use_flusher("python", monkeypatch)  # the interleaving forced is the Python thread's; the C one's is below
    with LogStore(tmp_path / "store", SMALL) as store:
        flusher = store.flusher
        [appended] = store.append([Message("orders", "m1", b"x")])
        real_sync = Segment.sync
        in_failing_fsync, fail_now = threading.Event(), threading.Event()
        calls = []

        def sync_failing_once(segment) -> None:
            calls.append(threading.current_thread().name)
            if len(calls) == 1:  # the flusher thread's round
                in_failing_fsync.set()
                fail_now.wait(WAIT_LIMIT_S)
                raise OSError(errno.EIO, "injected: EIO on fdatasync")
            real_sync(segment)

        monkeypatch.setattr(Segment, "sync", sync_failing_once)
        flusher.request(appended.end)
        assert in_failing_fsync.wait(WAIT_LIMIT_S)
        with flusher._cond:  # the failed round cannot reach `_finish` while this thread holds it
            fail_now.set()
            assert flusher._sync_lock.acquire(timeout=WAIT_LIMIT_S)  # the failed round let go of it
            flusher._sync_lock.release()
            with pytest.raises(FlushFailed):
                flusher.sync_now()
            assert len(calls) == 1 and flusher.durable_offset < appended.end
        monkeypatch.undo()


def test_after_the_c_threads_fsync_failed_no_round_runs_and_every_waiter_hears_of_it(tmp_path, monkeypatch) -> None:
    """The C thread (qmq/store/_sync_thread.pyx): its rounds and a caller's `sync_now` share one lock
    and one failure, so once its fsync failed no fsync runs anywhere. A loop's waiter, a blocking
    waiter and every later `sync_now` get `FlushFailed`; the recovery point stays where the last good
    fsync left it, closing included."""
    use_flusher("c", monkeypatch)
    with LogStore(tmp_path / "store", SMALL) as store:
        flusher = store.flusher
        assert flusher.compiled
        [first] = store.append([Message("orders", "m1", b"x")])
        store.flusher.wait_durable(first.end, WAIT_LIMIT_S)
        good = store.durable_offset
        syncs = flusher.syncs
        flusher._native.fail_next(errno.EIO)
        [appended] = store.append([Message("orders", "m2", b"y")])

        async def loop_waiter() -> None:
            with pytest.raises(FlushFailed, match="EIO"):
                await asyncio.wait_for(store.durable(appended.end), WAIT_LIMIT_S)

        asyncio.run(loop_waiter())
        with pytest.raises(FlushFailed):
            flusher.wait_durable(appended.end, WAIT_LIMIT_S)
        with pytest.raises(FlushFailed):
            flusher.sync_now()
        assert store.durable_offset == good < appended.end
        assert flusher.syncs == syncs + 1  # the failed round, and none after it
    assert RecoveryPoint(tmp_path / "store").load() == good


@pytest.mark.parametrize("flusher", FLUSHERS)
@pytest.mark.parametrize("closer", ["loop", "thread"])
def test_a_wait_pending_when_the_store_closes_is_settled_by_the_last_round(
    tmp_path, monkeypatch, flusher, closer
) -> None:
    """An acknowledgement's wait lingers (`linger_s`) without asking for an fsync; the store closes
    meanwhile, from its loop or from another thread: the close's last round covers it and settles
    it, it does not hang."""
    use_flusher(flusher, monkeypatch)
    store = LogStore(tmp_path / "store", SMALL)
    [appended] = store.append([Message("orders", "m1", b"x")])

    async def scenario() -> None:
        wait = asyncio.ensure_future(store.durable(appended.end, linger_s=WAIT_LIMIT_S * 3))
        await asyncio.sleep(0)  # the wait registers
        if closer == "loop":
            store.close()
        else:
            await asyncio.to_thread(store.close)
        await asyncio.wait_for(wait, WAIT_LIMIT_S)

    asyncio.run(scenario())
    assert store.durable_offset >= appended.end


def test_a_flush_asked_for_across_a_failed_append_taken_back_claims_nothing_past_the_cut(tmp_path) -> None:
    """A request reads the log's end, then the appending thread takes a failed append back
    (`forget_after`) before the request reaches the C thread: the request is stale and ignored, so
    bytes written later below that old end are not said durable without an fsync of their own."""
    with LogStore(tmp_path / "store", SMALL) as store:
        flusher, log = store.flusher, store.message_log
        assert flusher.compiled
        [first] = store.append([Message("orders", "m1", b"x")])
        flusher.wait_durable(first.end, WAIT_LIMIT_S)
        cut = log.end_offset
        log.append([b"\0" * 200])  # a failing append's bytes, not taken back yet
        old_end = log.end_offset
        real_sync_files = log.sync_files

        def taken_back_meanwhile():
            files = real_sync_files()
            log.undo_append(cut)
            flusher.forget_after(cut)
            return files

        log.sync_files = taken_back_meanwhile
        flusher.request(old_end)
        log.sync_files = real_sync_files
        syncs = flusher.syncs
        [later] = store.append([Message("orders", "m2", b"y" * 300)])  # past the old end: not asked for
        assert later.end > old_end
        flusher.sync_now()  # a round to wait for: the stale request must not have run one before it
        assert flusher.syncs == syncs + 1
        assert RecoveryPoint(tmp_path / "store").load() == later.end


def test_the_c_thread_leaves_no_eventfd_behind(tmp_path) -> None:
    """Each loop that waited on a store gets an eventfd; closing the store, whether its loop ran
    to the end, stopped or was closed after it, closes it."""
    fds = Path("/proc/self/fd")
    before = len(list(fds.iterdir()))
    for i in range(5):
        store = LogStore(tmp_path / f"store{i}", SMALL)
        assert store.flusher.compiled
        [appended] = store.append([Message("orders", "m1", b"x")])
        loop = asyncio.new_event_loop()
        loop.run_until_complete(store.durable(appended.end))
        store.close()  # the loop stopped, not closed
        loop.close()
    with LogStore(tmp_path / "last", SMALL) as store:
        [appended] = store.append([Message("orders", "m1", b"x")])
        asyncio.run(store.durable(appended.end))
    assert len(list(fds.iterdir())) == before
