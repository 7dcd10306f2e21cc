"""A damaged consumption snapshot, or one claiming more of the journal than the journal holds, is
discarded with a WARNING and the state rebuilt from the journal: no refusal to start, no positions
guessed (issue 19, case 2)."""

from __future__ import annotations

import asyncio
import logging

import msgpack
import pytest

from qmq.broker import snapshot
from qmq.broker.service import STATE_DIR, BrokerService
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.store.files import sealed
from qmq.store.store import LogStore
from tests.support.stores import SMALL

PEER = PeerInfo("127.0.0.1", 1, "test")


async def call(service: BrokerService, code: int, body: dict) -> dict:
    return await service.handle(Request(1, code, body), PEER)


def pull_body(group: str) -> dict:
    return {"subject": "orders", "group": group, "consumer": "c", "start": "earliest", "wait_ms": 0, "max": 100}


async def consume_half(data_dir) -> None:
    with LogStore(data_dir, SMALL) as store:
        service = BrokerService(store)
        messages = [{"id": f"m{i}", "subject": "orders", "payload": b"x"} for i in range(10)]
        await call(service, RequestCode.BROKER_SEND, {"messages": messages})
        [batch] = (await call(service, RequestCode.BROKER_PULL, {**pull_body("g"), "max": 5}))["batches"]
        last = batch["first_pull"] + len(batch["messages"]) - 1
        await call(service, RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c", last]]})
        await service.close()


async def remaining_ids(data_dir) -> list[str]:
    with LogStore(data_dir, SMALL) as store:
        service = BrokerService(store)
        reply = await call(service, RequestCode.BROKER_PULL, {**pull_body("g"), "consumer": "c2"})
        await service.stop_background()
        return [m["id"] for b in reply["batches"] for m in b["messages"]]


@pytest.mark.parametrize("damage", ["bit-flip", "claims-more"])
def test_a_bad_snapshot_is_rebuilt_from_the_journal(tmp_path, caplog, damage) -> None:
    asyncio.run(consume_half(tmp_path))
    path = tmp_path / STATE_DIR / snapshot.FILE_NAME
    data = path.read_bytes()
    if damage == "bit-flip":
        path.write_bytes(data[:20] + bytes([data[20] ^ 0x01]) + data[21:])
    else:
        state = snapshot.load(tmp_path / STATE_DIR)
        state["journal_seq"] += 1000
        path.write_bytes(sealed(msgpack.packb(state, use_bin_type=True)))
    with caplog.at_level(logging.WARNING, logger="qmq.broker"):
        ids = asyncio.run(remaining_ids(tmp_path))
    assert ids == [f"m{i}" for i in range(5, 10)], "the acked half stays acked, the rest is delivered"
    assert any("discarding the snapshot" in r.getMessage() for r in caplog.records), caplog.text
