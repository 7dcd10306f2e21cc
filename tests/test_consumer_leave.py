"""A consumer that closes gives back what it holds unacknowledged at once (BROKER_LEAVE), on a real
`qmq broker` whose consumer timeout is far longer than the tests: what the application was handed
comes back with one attempt more, what was fetched ahead and never seen keeps its attempt, and a
pull that was waiting for the consumer takes nothing after it left."""

from __future__ import annotations

import asyncio

import pytest

from qmq.client import AsyncClient, Client
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.broker import Broker, RawConsumer, send, start_broker

CONSUMER_TIMEOUT_S = 600  # the sweep never runs during these tests: only a leave gives messages back
WAIT_S = 20.0  # a pull left waiting at the broker when its subscription closes


@pytest.fixture
def broker(processes, tmp_path) -> Broker:
    return start_broker(processes, tmp_path / "broker", "--consumer-timeout", str(CONSUMER_TIMEOUT_S))


def ids(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:03d}" for i in range(n)]


def others_get(broker: Broker, n: int) -> dict[str, int]:
    """What another consumer of the group gets, id -> attempt (acked), after at most a few empty pulls."""
    other = RawConsumer(broker.connect(client_id="other"), "orders", "billing", "other", {"start": "earliest"})
    return {d.id: d.attempt for d in other.drain(n, wait_ms=2000, empty_pulls=2)}


def test_a_closed_subscription_gives_back_at_once_counting_only_what_the_application_saw(broker):
    with broker.connect() as conn:
        send(conn, "orders", ids("m", 5))
    client = Client(brokers=[broker.address])
    subscription = client.subscribe("orders", "billing", consumer="leaver", start="earliest", prefetch=True)
    handed = subscription.pull(max=4, wait_s=WAIT_S)  # its registration pull got all five: one stays held
    assert [d.id for d in handed] == ids("m", 5)[:4]  # and the next pull now waits at the broker
    subscription.ack(handed[0])
    subscription.close()  # the ack goes out, then the other four go back
    assert others_get(broker, 4) == {"m-001": 2, "m-002": 2, "m-003": 2, "m-004": 1}
    with broker.connect() as conn:  # sent while the closed subscription's pull would still be waiting
        send(conn, "orders", ids("late", 3))
    assert others_get(broker, 3) == {i: 1 for i in ids("late", 3)}
    client.close()


def test_an_async_subscription_gives_back_on_close_too(broker):
    async def scenario() -> list[str]:
        async with AsyncClient(brokers=[broker.address]) as client:
            subscription = await client.subscribe("orders", "billing", consumer="aleaver", prefetch=True)
            with broker.connect() as conn:
                send(conn, "orders", ids("a", 5))
            handed = await subscription.pull(max=2, wait_s=WAIT_S)
            await subscription.close()
            return [d.id for d in handed]

    handed = asyncio.run(scenario())
    assert handed == ids("a", 5)[:2]
    assert others_get(broker, 5) == {i: (2 if i in handed else 1) for i in ids("a", 5)}


def test_leave_over_the_raw_protocol(broker):
    with broker.connect() as conn:
        send(conn, "orders", ids("m", 6))
        raw = RawConsumer(broker.connect(client_id="raw"), "orders", "billing", "raw", {"start": "earliest"})
        assert len(raw.pull(6)) == 6
        nobody = [["orders", "billing", "nobody", 3], ["orders", "unknown-group", "raw", 3]]
        assert conn.request(RequestCode.BROKER_LEAVE, {"leaves": nobody}) == {"released": 0}
        for bad in ([["orders", "billing", "raw"]], [["orders", "billing", "raw", "3"]], "x", [5]):
            with pytest.raises(RemoteError) as refused:
                conn.request(RequestCode.BROKER_LEAVE, {"leaves": bad})
            assert refused.value.code == ErrorCode.BAD_REQUEST
        with pytest.raises(RemoteError) as refused:
            conn.request(RequestCode.BROKER_LEAVE, {"leaves": [["orders", "billing", "bad consumer!", 0]]})
        assert refused.value.code != ErrorCode.INTERNAL
        assert conn.request(RequestCode.BROKER_LEAVE, {"leaves": [["orders", "billing", "raw", 2]]}) == {"released": 6}
        assert conn.request(RequestCode.BROKER_LEAVE, {"leaves": [["orders", "billing", "raw", 2]]}) == {"released": 0}
    assert others_get(broker, 6) == {i: (2 if n <= 2 else 1) for n, i in enumerate(ids("m", 6))}
