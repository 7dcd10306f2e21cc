"""A delay server's delivery fired again (after a crash or a failover) is not stored twice by a broker
(qmq/broker/dedupe.py): a real broker process, raw BROKER_SEND frames, then a restart, so the key
index that answers is the one rebuilt from disk."""

from __future__ import annotations

import asyncio
import signal

from qmq.client.messages import ForwardedMessage
from qmq.ids import new_id
from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from tests.support.broker import HOST, RawConsumer, restart_broker, start_broker

SUBJECT = "dedupe.orders"


def _send(conn, messages: list[dict]) -> dict:
    return conn.request(RequestCode.BROKER_SEND, {"messages": messages})


def _stored(conn) -> int:
    return conn.request(RequestCode.BROKER_STATS, {})["subjects"].get(SUBJECT, {}).get("stored", 0)


def test_a_refired_delay_delivery_is_stored_once_and_an_unmarked_send_is_not_looked_up(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "b")
    fired = [ForwardedMessage(SUBJECT, payload=b"p%d" % i, id=new_id(), key=str(i)).to_wire() for i in range(20)]
    assert all(m["once"] is True for m in fired)  # what the delay server sends
    with broker.connect() as conn:
        assert _send(conn, fired) == {"stored": 20, "rejected": []}
        # Fired again, as after a kill while firing: answered as stored, not stored.
        assert _send(conn, fired[:10]) == {"stored": 10, "rejected": []}
        assert _stored(conn) == 20
        # The same id under another subject is another message; and a producer's own send (unmarked)
        # is never looked up: the broker's hot path is unchanged.
        other = {**fired[0], "subject": SUBJECT + ".other"}
        unmarked = {k: v for k, v in fired[1].items() if k != "once"}
        assert _send(conn, [other, unmarked]) == {"stored": 2, "rejected": []}
        assert _stored(conn) == 21
    processes.kill(broker.proc, signal.SIGKILL)
    broker = restart_broker(processes, broker)
    with broker.connect() as conn:
        # After a crash the index rebuilt from the message log still knows them (and a new id goes in).
        fresh = ForwardedMessage(SUBJECT, payload=b"new", id=new_id()).to_wire()
        assert _send(conn, [*fired, fresh]) == {"stored": 21, "rejected": []}
        assert _stored(conn) == 22
        consumer = RawConsumer(conn, SUBJECT, "g", "c1", options={"start": "earliest"})
        got: list[str] = []
        while len(got) < 22:
            batch = consumer.pull(max_count=64, wait_ms=1000)
            if not batch:
                break
            got += [d.id for d in batch]
            consumer.ack(batch)
        expected = [m["id"] for m in fired] + [fired[1]["id"], fresh["id"]]
        assert sorted(got) == sorted(expected)  # each fired id once, the unmarked copy once more


def test_copies_arriving_together_are_stored_once(processes, tmp_path) -> None:
    """Two copies in one send, or in two sends the broker reads in the same moment (neither is in the
    key index yet): the second waits for the first and is answered as stored, not stored again."""
    broker = start_broker(processes, tmp_path / "b")
    fired = [ForwardedMessage(SUBJECT, payload=b"p%d" % i, id=new_id()).to_wire() for i in range(50)]

    async def twice_at_once() -> list[dict]:
        async with await AsyncConnection.open(HOST, broker.port, client_id="dedupe-test", token="") as conn:
            return list(
                await asyncio.gather(*(conn.request(RequestCode.BROKER_SEND, {"messages": fired}) for _ in range(2)))
            )

    with broker.connect() as conn:
        assert _send(conn, [fired[0], fired[0]]) == {"stored": 2, "rejected": []}  # both answered stored
        assert _stored(conn) == 1
        assert asyncio.run(twice_at_once()) == [{"stored": 50, "rejected": []}] * 2
        assert _stored(conn) == 50
