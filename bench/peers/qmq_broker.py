"""qmq: a real `qmq broker --flush sync` process (started by bench/broker.py's `BrokerProcess`).

Two rows. The first, the one every peer is compared with, goes through the client library like the
peers' rows go through theirs: `AsyncClient.send` of 64 messages, 8 calls outstanding;
`AsyncSubscription.pull(1024)` with `prefetch=True` (the next pull in flight while a batch is handled,
as RabbitMQ's prefetch and a Kafka consumer's fetch keep messages coming) and an ack per delivery
(the client batches acks); latency with
`send_one` and a subscription already long-polling, also with `prefetch=True`, as a consumer that
wants its messages soon is set up (a message stored between two pulls is served to it ahead,
qmq/broker/ahead.py). The second speaks the wire protocol directly
(bench/broker.py's own cases: the same batches on 2 connections x 4, two consumers of the group):
what the broker can do when the client's per-message work is not in the way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager

from bench.broker import BrokerProcess, client_consume, client_produce
from bench.broker import consume as wire_consume
from bench.broker import latency as wire_latency
from bench.broker import produce as wire_produce
from bench.peers.workload import (
    BATCH,
    CONSUME_BATCH,
    HOST,
    IN_FLIGHT,
    Measurement,
    Options,
    arrived,
    paced,
    record_receipt,
)
from qmq.client import AsyncClient

DURABILITY = "fsync before every reply (--flush sync, group commit): sends, and the journal entries of pulls and acks"
SYNCED = "yes: group commit"
LATENCY_PULL_WAIT_S = 2.5
LATENCY_SUBJECT = "lat"


async def client_latency(port: int, options: Options) -> list[float]:
    delays: list[float] = []
    total = int(options.latency_rate * options.latency_seconds)
    async with AsyncClient(brokers=[f"{HOST}:{port}"]) as client:
        subscription = await client.subscribe(LATENCY_SUBJECT, "lat", start="earliest", prefetch=True)

        async def receive() -> None:
            while len(delays) < total:
                for delivery in await subscription.pull(BATCH * 4, LATENCY_PULL_WAIT_S):
                    record_receipt(delays, delivery.body)
                    await subscription.ack(delivery)

        receiver = asyncio.create_task(receive())
        try:
            await paced(lambda body: client.send_one(LATENCY_SUBJECT, body), options)
            await arrived(delays, total)
            await receiver
        finally:
            receiver.cancel()
            await subscription.close()
    return delays


@contextmanager
def broker() -> Iterator[int]:
    """A fresh `qmq broker --flush sync` for one row; its port."""
    process = BrokerProcess("sync")
    try:
        yield process.port
    finally:
        process.stop()


def measure_client(options: Options) -> Measurement:
    result = Measurement(
        "qmq broker",
        SYNCED,
        DURABILITY,
        f"qmq.client.AsyncClient, send batches of {BATCH} x {IN_FLIGHT} outstanding; pull "
        f"{CONSUME_BATCH} with prefetch (the next pull in flight meanwhile), ack each (batched by the client); "
        "latency: send_one, a prefetching subscription pulling 256",
    )
    with broker() as port:
        result.produce = asyncio.run(client_produce(port, options.messages, BATCH, options.size, IN_FLIGHT))["rate"]
        result.consume = asyncio.run(client_consume(port, options.messages, CONSUME_BATCH, prefetch=True))["rate"]
        result.latency(asyncio.run(client_latency(port, options)))
    return result


def measure_wire(options: Options) -> Measurement:
    result = Measurement(
        "qmq broker, wire protocol",
        SYNCED,
        DURABILITY,
        f"qmq.net.aio_client (bench/broker.py), batches of {BATCH}, 2 connections x 4 "
        f"outstanding; 2 consumers pulling {CONSUME_BATCH}",
    )
    with broker() as port:
        result.produce = asyncio.run(
            wire_produce(port, options.messages, BATCH, options.size, connections=2, inflight=IN_FLIGHT // 2)
        )["rate"]
        result.consume = asyncio.run(wire_consume(port, options.messages, CONSUME_BATCH))["rate"]
        figures = asyncio.run(wire_latency(port, options.latency_rate, options.latency_seconds, options.size))
    result.p50_ms, result.p99_ms, result.max_ms = figures["p50_ms"], figures["p99_ms"], figures["max_ms"]
    return result


def measure(options: Options) -> list[Measurement]:
    return [measure_client(options), measure_wire(options)]
