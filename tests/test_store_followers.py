"""The master's side of replication without a network (qmq/store/followers.py): REPL_FETCH bodies in,
chunks out; the acknowledgement rule; which replicas are in sync; a newer epoch deposes the master."""

from __future__ import annotations

import asyncio
import time

import pytest

from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store.followers import Followers, NotEnoughReplicas
from qmq.store.replication import split_chunk
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

MAX_LAG_S = 0.3


def fetch_body(offset: int, *, replica: str = "r:1", epoch: int = 1, wait_ms: int = 0) -> dict:
    return {
        "group": "g",
        "replica": replica,
        "epoch": epoch,
        "offset": offset,
        "max_bytes": 1 << 20,
        "wait_ms": wait_ms,
    }


def run(coro):
    return asyncio.run(coro)


def test_a_send_is_acknowledged_once_the_replica_fetched_past_it(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=MAX_LAG_S)
            await followers.fetch(fetch_body(0))  # the replica is there and caught up
            assert followers.in_sync() == ["r:1"] and followers.writable
            end = store.append([Message("s", "m1", b"x")])[-1].end
            acked = asyncio.ensure_future(followers.acknowledged(end))
            await asyncio.sleep(0)
            assert not acked.done()  # the replica does not have it yet
            reply = await followers.fetch(fetch_body(0))
            assert reply["end"] == end and [r.message_id for r in split_chunk(reply["data"], 0)[1]] == ["m1"]
            assert not acked.done()  # shipped is not durable on the replica
            await followers.fetch(fetch_body(end))  # the next fetch says it is
            await asyncio.wait_for(acked, 1)

    run(scenario())


def test_a_fetch_waits_for_new_records(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=60)
            waiting = asyncio.ensure_future(followers.fetch(fetch_body(0, wait_ms=5000)))
            await asyncio.sleep(0.05)
            assert not waiting.done()  # a long poll: nothing to send yet
            store.append([Message("s", "m1", b"x")])
            reply = await asyncio.wait_for(waiting, 2)  # woken by the append, not by its timeout
            assert reply["data"]

    run(scenario())


def test_a_lagging_replica_falls_out_of_sync(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=MAX_LAG_S)
            caught_up = time.monotonic()  # this fetch finds the replica at the end of the (empty) log
            await followers.fetch(fetch_body(0))
            store.append([Message("s", "m1", b"x")])
            reply = await followers.fetch(fetch_body(0))
            assert reply["data"]  # shipped, never reported durable
            end = store.end_offset
            pending = asyncio.ensure_future(followers.acknowledged(end))
            await asyncio.sleep(0)
            while followers.writable:  # lag is time passing: nothing to await but the clock
                await asyncio.sleep(0.02)
                followers.check()
            assert MAX_LAG_S * 0.9 <= time.monotonic() - caught_up < MAX_LAG_S + 1
            followers.check()
            with pytest.raises(NotEnoughReplicas):
                await pending
            with pytest.raises(NotEnoughReplicas):
                await followers.acknowledged(end)
            await followers.fetch(fetch_body(end))  # back and caught up: in sync again
            assert followers.writable

    run(scenario())


def test_an_idle_replica_stays_in_sync_through_its_long_polls(tmp_path) -> None:
    """A caught-up replica parked in a long poll must not age out of sync: the wait is cut to half
    of max_lag_s (a replica asking 5 s against `--max-lag 300ms`), so it fetches again in time. One
    that never fetches again (killed while parked) is out of sync max_lag_s after its last fetch."""

    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            store.append([Message("s", "m1", b"x")])
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=MAX_LAG_S)
            asked = time.monotonic()
            reply = await asyncio.wait_for(followers.fetch(fetch_body(store.end_offset, wait_ms=5000)), 2)
            answered = time.monotonic()
            assert reply["data"] == b"" and answered - asked >= MAX_LAG_S / 2 * 0.9
            assert answered - asked < MAX_LAG_S and followers.in_sync() == ["r:1"]
            await followers.fetch(fetch_body(store.end_offset))  # the next fetch, in time
            assert followers.in_sync() == ["r:1"]
            assert followers.in_sync(now=time.monotonic() + MAX_LAG_S + 0.1) == []  # and then no more

    run(scenario())


def test_a_new_replica_is_in_sync_only_once_caught_up(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            store.append([Message("s", f"m{i}", b"x" * 100) for i in range(50)])
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=MAX_LAG_S)
            await followers.fetch(fetch_body(0, replica="new:1"))
            assert followers.in_sync() == []
            await followers.fetch(fetch_body(store.end_offset, replica="new:1"))
            assert followers.in_sync() == ["new:1"]

    run(scenario())


def test_bad_fetches_and_a_newer_epoch(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            seen: list[int] = []
            followers = Followers(store, epoch=2, epochs=[(1, 0), (2, 0)], ack_replicas=1, on_newer_epoch=seen.append)
            with pytest.raises(RemoteError) as past:
                await followers.fetch(fetch_body(10, epoch=2))
            assert past.value.code == ErrorCode.BAD_REQUEST and "truncate" in past.value.message
            assert (await followers.epoch_end({"epoch": 1}))["end_offset"] == 0
            with pytest.raises(RemoteError) as newer:
                await followers.fetch(fetch_body(0, epoch=3))
            assert newer.value.code == ErrorCode.NOT_MASTER and seen == [3]

    run(scenario())


def test_only_replicas_the_meta_server_heard_were_in_sync_acknowledge(tmp_path) -> None:
    """The meta server promotes only replicas it heard were in sync: a replica it has not heard of
    yet (just caught up) holding a send must not acknowledge it, or a failover to another could
    lose it. Once the meta server holds it (`counted` changes, `settle`), its offset counts."""

    async def scenario() -> None:
        heard: set[str] = {"r:1"}
        with LogStore(tmp_path / "s", SMALL) as store:
            followers = Followers(
                store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=MAX_LAG_S, counted=lambda: heard
            )
            await followers.fetch(fetch_body(0, replica="r:1"))
            await followers.fetch(fetch_body(0, replica="r:2"))
            end = store.append([Message("s", "m1", b"x")])[-1].end
            acked = asyncio.ensure_future(followers.acknowledged(end))
            await followers.fetch(fetch_body(0, replica="r:2"))
            await followers.fetch(fetch_body(end, replica="r:2"))  # r:2 has it durable
            await asyncio.sleep(0)
            assert not acked.done()  # r:2 is not among those the meta server would promote
            assert {r["address"]: r["acknowledges"] for r in followers.stats()} == {"r:1": True, "r:2": False}
            heard.add("r:2")
            followers.settle()
            await asyncio.wait_for(acked, 1)
            # and r:1, heard of all along, acknowledges what it holds
            end2 = store.append([Message("s", "m2", b"x")])[-1].end
            heard.discard("r:2")
            acked2 = asyncio.ensure_future(followers.acknowledged(end2))
            await followers.fetch(fetch_body(end, replica="r:2"))
            await followers.fetch(fetch_body(end2, replica="r:2"))
            await asyncio.sleep(0)
            assert not acked2.done()
            await followers.fetch(fetch_body(0, replica="r:1"))
            await followers.fetch(fetch_body(end2, replica="r:1"))
            await asyncio.wait_for(acked2, 1)

    run(scenario())


def test_no_acknowledgement_waits_on_a_master_that_was_closed(tmp_path) -> None:
    """`close` fails the waiting acknowledgements; one asked for after it must fail too, not wait for
    a settle that will never come (the replica is still in sync by the clock)."""

    async def scenario() -> None:
        with LogStore(tmp_path / "s", SMALL) as store:
            followers = Followers(store, epoch=1, epochs=[(1, 0)], ack_replicas=1, max_lag_s=60)
            await followers.fetch(fetch_body(0))
            end = store.append([Message("s", "m1", b"x")])[-1].end
            followers.close(RemoteError(ErrorCode.NOT_MASTER, "a new epoch began"))
            with pytest.raises(RemoteError) as closed:
                await asyncio.wait_for(followers.acknowledged(end), 2)
            assert closed.value.code == ErrorCode.NOT_MASTER

    run(scenario())
