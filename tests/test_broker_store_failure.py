"""A store that can no longer write (here: closed under the broker, as after a failed write) is
answered with UNAVAILABLE naming the cause, for every kind of request, never with INTERNAL."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import Awaitable, Callable

import pytest

from qmq.broker.service import BrokerService
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store.store import LogStore
from tests.support.stores import SMALL

PEER = PeerInfo("127.0.0.1", 1, "test")
MESSAGE = {"id": "m1", "subject": "orders", "payload": b"x"}
PULL = {"subject": "orders", "group": "g", "consumer": "c", "start": "earliest", "wait_ms": 0}

Call = Callable[[int, dict], Awaitable[dict]]


async def started(tmp_path) -> tuple[LogStore, BrokerService, Call]:
    """A broker service in this process on a store of its own, with MESSAGE stored; `call` sends it a
    request as a connection would."""
    store = LogStore(tmp_path / "b", SMALL)
    service = BrokerService(store)
    service.start()

    async def call(code: int, body: dict) -> dict:
        return await service.handle(Request(1, code, body), PEER)

    assert (await call(RequestCode.BROKER_SEND, {"messages": [MESSAGE]}))["stored"] == 1
    return store, service, call


def test_requests_on_a_store_that_cannot_write_are_unavailable(tmp_path) -> None:
    async def run() -> None:
        store, service, call = await started(tmp_path)
        [batch] = (await call(RequestCode.BROKER_PULL, PULL))["batches"]
        store.close()
        requests = [
            (RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c", batch["first_pull"]]]}),
            (RequestCode.BROKER_SEND, {"messages": [{**MESSAGE, "id": "m2"}]}),
            (RequestCode.BROKER_PULL, {**PULL, "group": "new-group"}),  # its creation must be journalled
            (RequestCode.BROKER_RESET, {"subject": "orders", "group": "g", "to": "earliest"}),
        ]
        for code, body in requests:
            with pytest.raises(RemoteError) as err:
                await call(code, body)
            assert err.value.code == ErrorCode.UNAVAILABLE, (code, err.value)
            assert "closed" in err.value.message
        await service.stop_background()

    asyncio.run(run())


def test_a_pull_whose_read_fails_part_way_leaves_its_journal_entry_for_the_next_handout(tmp_path) -> None:
    """A take journals what it applied even when a read fails after it (here a new group's creation,
    then an I/O error reading the subject): the next pull that hands messages out must not reply
    before that entry is durable, so its end is kept and its flush asked for."""

    async def run() -> None:
        store, service, call = await started(tmp_path)
        read = store.read

        def failing_read(subject, *args, **kwargs):
            if subject == "orders":
                raise OSError(errno.EIO, "Input/output error")
            return read(subject, *args, **kwargs)

        store.read = failing_read
        end_before = store.end_offset
        with pytest.raises((RemoteError, OSError)):
            await call(RequestCode.BROKER_PULL, PULL)
        assert store.end_offset > end_before  # the group's creation was journalled
        assert service.consuming.ahead.reserved_end == store.end_offset
        assert max(store.flusher.requested_offset, store.durable_offset) >= store.end_offset
        store.read = read
        [batch] = (await call(RequestCode.BROKER_PULL, PULL))["batches"]
        assert [m["id"] for m in batch["messages"]] == ["m1"]
        await service.stop_background()
        store.close()

    asyncio.run(run())
