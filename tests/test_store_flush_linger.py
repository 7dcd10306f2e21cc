"""A wait for durability that lingers (qmq/store/flush.py `Flusher.durable(linger_s=...)`, used for
acks): it asks for no fsync of its own at once, is covered by the next fsync another writer asks
for, and still gets one of its own when nobody else writes; either way it returns only once its
bytes are durable."""

from __future__ import annotations

import asyncio

from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

LONG_LINGER_S = 600.0  # never reached in the test that rides another fsync
SHORT_LINGER_S = 0.01
WAIT_LIMIT_S = 30.0


def test_a_lingering_wait_rides_the_next_writers_fsync(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "store", SMALL) as store:
            [ack] = store.append([Message("orders", "ack", b"a")])
            syncs = store.flusher.syncs
            lingering = asyncio.ensure_future(store.durable(ack.end, linger_s=LONG_LINGER_S))
            await asyncio.sleep(0)  # let it start waiting: it asks for nothing yet
            assert store.flusher.requested_offset < ack.end and not lingering.done()
            [send] = store.append([Message("orders", "send", b"s")])
            await asyncio.wait_for(store.durable(send.end), WAIT_LIMIT_S)
            await asyncio.wait_for(lingering, WAIT_LIMIT_S)  # covered by the send's fsync
            assert store.flusher.syncs == syncs + 1 and store.durable_offset >= send.end

    asyncio.run(scenario())


def test_a_lingering_wait_alone_gets_its_own_fsync(tmp_path) -> None:
    async def scenario() -> None:
        with LogStore(tmp_path / "store", SMALL) as store:
            [ack] = store.append([Message("orders", "ack", b"a")])
            syncs = store.flusher.syncs
            await asyncio.wait_for(store.durable(ack.end, linger_s=SHORT_LINGER_S), WAIT_LIMIT_S)
            assert store.durable_offset >= ack.end and store.flusher.syncs == syncs + 1

    asyncio.run(scenario())
