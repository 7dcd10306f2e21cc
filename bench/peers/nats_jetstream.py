"""NATS JetStream at 127.0.0.1:4222 through nats-py: a stream with file storage, one replica.

Produce: `publish_async` in batches of 64 whose PubAcks are awaited together, 8 batches outstanding.
Consume: a durable pull consumer with AckAll, `fetch(1024)`, one ack for the last message of each
fetch. Latency: `publish` (awaits its PubAck) one message at a time; a durable push consumer with
explicit acks, already subscribed.

Durability: nats-server 2.9.10 (Debian's) writes a stream's messages to its block files before the
PubAck but fsyncs them only on a background timer (the file store's sync interval: 2 minutes in
current sources); this version has no `sync_interval`/`sync_always` setting (its config parser
rejects the field), so nothing is configured: the server runs as started on this machine.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import nats
from nats.js.api import AckPolicy, ConsumerConfig, StorageType

from bench.peers.workload import (
    BATCH,
    CONSUME_BATCH,
    HOST,
    Measurement,
    Options,
    arrived,
    paced,
    payload,
    pipelined,
    record_receipt,
)

PORT = 4222
URL = f"nats://{HOST}:{PORT}"
DURABILITY = (
    "no fsync before PubAck: file storage, written to the page cache and fsynced on a background timer "
    "(2.9.10 cannot be set to sync every write)"
)
ACKS_SETTLED_TIMEOUT_S = 10.0


async def consume(js: nats.js.JetStreamContext, stream: str, subject: str, total: int) -> float:
    config = ConsumerConfig(ack_policy=AckPolicy.ALL, max_ack_pending=CONSUME_BATCH * 4)
    started = time.perf_counter()
    sub = await js.pull_subscribe(subject, durable="bench", stream=stream, config=config)
    got = 0
    while got < total:
        messages = await sub.fetch(CONSUME_BATCH, timeout=5)
        got += len(messages)
        await messages[-1].ack()  # AckAll: acknowledges every message up to this one
    deadline = time.monotonic() + ACKS_SETTLED_TIMEOUT_S
    while (await sub.consumer_info()).num_ack_pending:  # the acks were taken by the server
        if time.monotonic() > deadline:
            raise TimeoutError("JetStream still shows unacknowledged messages")
        await asyncio.sleep(0.005)
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    return total / elapsed


async def latency(js: nats.js.JetStreamContext, stream: str, subject: str, options: Options) -> list[float]:
    delays: list[float] = []

    async def on_message(message: nats.aio.msg.Msg) -> None:
        record_receipt(delays, message.data)
        await message.ack()

    sub = await js.subscribe(subject, durable="lat", stream=stream, cb=on_message, manual_ack=True)
    total = await paced(lambda body: js.publish(subject, body, stream=stream), options)
    await arrived(delays, total)
    await sub.unsubscribe()
    return delays


async def run(options: Options) -> Measurement:
    result = Measurement(
        "NATS JetStream 2.9",
        "no: fsync on a timer",
        DURABILITY,
        f"nats-py, file storage, publish_async in batches of {BATCH} x 8 outstanding; pull "
        f"fetch {CONSUME_BATCH}, AckAll",
    )
    name = f"QMQPEERS_{uuid.uuid4().hex[:8]}"
    subject, lat_subject = f"qmqpeers.{name}.bench", f"qmqpeers.{name}.lat"
    nc = await nats.connect(URL)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[subject, lat_subject], storage=StorageType.FILE)
    try:
        body = payload(options.size)

        async def send_batch(n: int) -> None:
            await asyncio.gather(*[await js.publish_async(subject, body) for _ in range(n)])

        result.produce = await pipelined(send_batch, options.messages)
        result.consume = await consume(js, name, subject, options.messages)
        result.latency(await latency(js, name, lat_subject, options))
    finally:
        await js.delete_stream(name)
        await nc.close()
    return result


def measure(options: Options) -> list[Measurement]:
    return [asyncio.run(run(options))]
