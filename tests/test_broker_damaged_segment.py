"""A damaged record in an old sealed segment (issue 19, case 4): the background scrub finds it and
reports it (log with file and offset, BROKER_STATS `damaged_records`), and a group reading past it
gets every other message instead of INTERNAL for ever, and the lost one in its dead letters with the
reason."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from qmq.broker.service import BrokerService
from qmq.net.server import PeerInfo
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

PEER = PeerInfo("127.0.0.1", 1, "test")
COUNT = 2000
SCRUBBING = dataclasses.replace(SMALL, background=True)
DEADLINE_S = 30.0


def fill(data_dir) -> dict[str, tuple[int, int]]:
    written = {}
    with LogStore(data_dir, SMALL) as store:
        for b in range(COUNT // 100):
            batch = [Message("orders", f"m-{b * 100 + i:05d}", b"p" * 200) for i in range(100)]
            for m, a in zip(batch, store.append_durable(batch), strict=True):
                written[m.message_id] = (a.offset, a.end)
    return written


def test_a_damaged_old_record_is_reported_and_skipped(tmp_path, caplog) -> None:
    written = fill(tmp_path)
    oldest = sorted((tmp_path / "messagelog").iterdir())[0]
    victim = "m-00010"
    offset, end = written[victim]
    with open(oldest, "r+b") as f:
        f.seek(end - int(oldest.name) - 1)
        byte = f.read(1)
        f.seek(end - int(oldest.name) - 1)
        f.write(bytes([byte[0] ^ 0xFF]))

    async def run() -> tuple[list[str], dict]:
        with LogStore(tmp_path, SCRUBBING) as store:
            deadline = time.monotonic() + DEADLINE_S
            while not store.damaged and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert [(p, o) for p, o, _ in store.damaged] == [(str(oldest), offset)]
            service = BrokerService(store)
            ids: list[str] = []
            pull = {"subject": "orders", "group": "g", "consumer": "c", "start": "earliest", "wait_ms": 0, "max": 500}
            for _ in range(20):
                reply = await service.handle(Request(1, RequestCode.BROKER_PULL, pull), PEER)
                got = [m["id"] for b in reply["batches"] for m in b["messages"]]
                if not got:
                    break
                ids.extend(got)
                acks = [[b["subject"], "g", "c", b["first_pull"] + len(b["messages"]) - 1] for b in reply["batches"]]
                await service.handle(Request(1, RequestCode.BROKER_ACK, {"acks": acks}), PEER)
            stats = await service.handle(Request(2, RequestCode.BROKER_STATS, {}), PEER)
            dead = await service.handle(
                Request(3, RequestCode.BROKER_DEAD_LIST, {"subject": "orders", "group": "g"}), PEER
            )
            await service.stop_background()
            return ids, stats, dead

    with caplog.at_level(logging.ERROR, logger="qmq.store"):
        ids, stats, dead = asyncio.run(run())
    [letter] = dead["messages"]
    assert letter["id"] == "unreadable:orders:10"
    assert (
        "unreadable" in letter["reason"] and str(oldest) in letter["reason"] and f"offset {offset}" in letter["reason"]
    )

    assert ids == sorted(set(written) - {victim})
    assert stats["damaged_records"] >= 1
    assert any(str(oldest) in r.getMessage() and f"offset {offset}" in r.getMessage() for r in caplog.records)
