"""Group commit (qmq/store/group_commit.py) on a real store: the writes of one loop iteration share
one append, each gets its own positions once durable, `on_durable` sees every message in log order
before the writes return, and a store that cannot take the append fails every write of the group."""

from __future__ import annotations

import asyncio

import pytest

from qmq.store.group_commit import GroupCommit, Written
from qmq.store.store import LogStore, Message, StoreError
from tests.support.stores import SMALL


def test_writes_of_one_iteration_share_an_append_and_settle_in_log_order(tmp_path) -> None:
    async def scenario() -> None:
        store = LogStore(tmp_path / "store", SMALL)
        appends: list[int] = []
        durable: list[Written] = []
        commit = GroupCommit(store, on_appended=lambda m: appends.append(len(m)), on_durable=durable.append)
        batches = [[Message("orders", f"w{w}-m{i}", b"x") for i in range(w + 1)] for w in range(5)]
        results = await asyncio.gather(*(commit.write(batch) for batch in batches))
        assert appends == [15]  # five writes, one append
        assert [len(r) for r in results] == [1, 2, 3, 4, 5]
        offsets = [a.offset for r in results for a in r]
        assert offsets == sorted(offsets)  # in the order the writes came
        assert store.durable_offset >= results[-1][-1].end
        assert [(a.offset, m.message_id) for group in durable for a, m in group] == [
            (a.offset, m.message_id) for r, b in zip(results, batches, strict=True) for a, m in zip(r, b, strict=True)
        ]
        later = await commit.write([Message("orders", "later", b"y")])  # another iteration, another append
        assert appends == [15, 1] and later[0].offset > offsets[-1]

        store.close()
        writes = [commit.write([Message("orders", f"refused-{i}", b"z")]) for i in range(3)]
        for outcome in await asyncio.gather(*writes, return_exceptions=True):
            assert isinstance(outcome, StoreError) and "closed" in str(outcome)
        await commit.close()

    asyncio.run(scenario())


def test_an_error_in_on_durable_fails_the_writes_of_its_group(tmp_path) -> None:
    async def scenario() -> None:
        def refuse(written: Written) -> None:
            raise OSError("the schedule log cannot be written")

        with LogStore(tmp_path / "store", SMALL) as store:
            commit = GroupCommit(store, on_durable=refuse)
            with pytest.raises(OSError, match="schedule log"):
                await commit.write([Message("orders", "m", b"x")])

    asyncio.run(scenario())


def test_the_flush_is_asked_for_with_the_append_or_after_what_it_made_ready(tmp_path) -> None:
    """Alone, a write's flush is asked for in its append's own loop step. When `on_appended` says it
    made steps ready that will append (a woken pull journalling its take), they append before the
    flush is asked for, so one fsync covers the write and them. `close` returns only once every
    write appended so far is settled."""

    async def scenario() -> None:
        with LogStore(tmp_path / "store", SMALL) as store:
            alone = GroupCommit(store)
            write = alone.write([Message("orders", "m1", b"x")])
            await asyncio.sleep(0)  # one loop step: the append
            assert store.end_offset > 0 and store.flusher.requested_offset == store.end_offset
            await alone.close()
            assert write.done() and write.result()[0].end <= store.durable_offset

            loop = asyncio.get_running_loop()
            journalled: list[int] = []

            def woken(messages: list[Message]) -> bool:
                journal = lambda: journalled.append(store.append([Message("journal", "j1", b"j")])[0].end)  # noqa: E731
                loop.call_soon(journal)
                return True  # a step that will append is ready

            commit = GroupCommit(store, on_appended=woken)
            syncs = store.flusher.syncs
            write = commit.write([Message("orders", "m2", b"x")])
            await asyncio.sleep(0)  # one loop step: the append
            await commit.close()
            assert write.done() and write.result()[0].end <= store.durable_offset
            assert journalled and journalled[0] <= store.durable_offset  # the one fsync covered it too
            assert store.flusher.syncs == syncs + 1

    asyncio.run(scenario())


def test_a_cancelled_close_leaves_the_other_closers_waiting_and_a_raising_hook_loses_nothing(tmp_path) -> None:
    """Closers share what they wait on: one cancelled must not cancel the others, nor a later
    `close`. An `on_appended` that raises does not leave its writes unsettled: they are stored,
    and are answered once durable."""

    async def scenario() -> None:
        with LogStore(tmp_path / "store", SMALL) as store:

            def broken(messages: list[Message]) -> bool:
                raise RuntimeError("a listener's bug")

            commit = GroupCommit(store, on_appended=broken)
            write = commit.write([Message("orders", "m1", b"x")])
            await asyncio.sleep(0)  # one loop step: the append
            first = asyncio.ensure_future(commit.close())
            second = asyncio.ensure_future(commit.close())
            await asyncio.sleep(0)  # both wait now
            first.cancel()
            await second  # not cancelled by the first
            assert first.cancelled()
            assert write.done() and write.result()[0].end <= store.durable_offset
            await commit.close()  # nothing left: returns at once

    asyncio.run(scenario())
