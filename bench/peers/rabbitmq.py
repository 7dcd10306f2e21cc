"""RabbitMQ at 127.0.0.1:5672 (guest/guest) through aio-pika: persistent messages, publisher confirms,
a durable queue, quorum or classic (both are measured; each is its own row).

Produce: one channel in confirm mode, batches of 64 publishes awaited together, 8 batches outstanding
(AMQP has no batch publish; confirms are pipelined instead). Consume: prefetch 1,024, manual acks,
`ack(multiple=True)` every 256 messages. Latency: one publish at a time, a consumer already
subscribed, acking each message.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
from aio_pika.abc import AbstractChannel, AbstractQueue

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

PORT = 5672
URL = f"amqp://guest:guest@{HOST}:{PORT}/"
ACK_EVERY = CONSUME_BATCH // 4  # messages per ack(multiple=True)
QUEUE_TYPES = ("quorum", "classic")
SYNCED = {"quorum": "yes: Raft log fsync", "classic": "yes: message store fsync"}
DURABILITY = {
    "quorum": "fsync before confirm: a quorum queue confirms once its Raft log entry is fsynced (one node)",
    "classic": "fsync before confirm: a persistent message in a durable classic queue is confirmed after the "
    "message store fsyncs it (batched)",
}


async def declare(channel: AbstractChannel, name: str, queue_type: str) -> AbstractQueue:
    return await channel.declare_queue(name, durable=True, arguments={"x-queue-type": queue_type})


async def produce(channel: AbstractChannel, queue: str, options: Options) -> float:
    body = payload(options.size)

    async def send_batch(n: int) -> None:
        await asyncio.gather(
            *(
                channel.default_exchange.publish(
                    aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=queue
                )
                for _ in range(n)
            )
        )

    return await pipelined(send_batch, options.messages)


async def consume(connection: aio_pika.abc.AbstractConnection, name: str, queue_type: str, total: int) -> float:
    loop = asyncio.get_running_loop()
    channel = await connection.channel()
    await channel.set_qos(prefetch_count=CONSUME_BATCH)
    queue = await declare(channel, name, queue_type)
    got = 0
    started = loop.time()
    async with queue.iterator() as messages:
        async for message in messages:
            got += 1
            if got % ACK_EVERY == 0 or got == total:
                await message.ack(multiple=True)
            if got == total:
                break
    await channel.declare_queue(name, passive=True)  # a round trip: the acks before it were taken
    elapsed = loop.time() - started
    await channel.close()
    return total / elapsed


async def latency(
    connection: aio_pika.abc.AbstractConnection, name: str, queue_type: str, options: Options
) -> list[float]:
    consumer = await connection.channel()
    await consumer.set_qos(prefetch_count=BATCH * 4)
    queue = await declare(consumer, name, queue_type)
    delays: list[float] = []

    async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
        record_receipt(delays, message.body)
        await message.ack()

    tag = await queue.consume(on_message)
    producer = await connection.channel()
    total = await paced(
        lambda body: producer.default_exchange.publish(
            aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT), routing_key=name
        ),
        options,
    )
    await arrived(delays, total)
    await queue.cancel(tag)
    await producer.close()
    await consumer.close()
    return delays


async def run(queue_type: str, options: Options) -> Measurement:
    result = Measurement(
        f"RabbitMQ 3.10, {queue_type} queue",
        SYNCED[queue_type],
        DURABILITY[queue_type],
        f"aio-pika, persistent, confirms, batches of {BATCH} x 8 outstanding; "
        f"prefetch {CONSUME_BATCH}, ack multiple every {ACK_EVERY}",
    )
    name = f"qmq-peers-{queue_type}-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await declare(channel, name, queue_type)
        result.produce = await produce(channel, name, options)
        await channel.close()
        result.consume = await consume(connection, name, queue_type, options.messages)
        result.latency(await latency(connection, name + "-lat", queue_type, options))
    finally:
        cleanup = await connection.channel()
        for queue in (name, name + "-lat"):
            await cleanup.queue_delete(queue)
        await connection.close()
    return result


def measure(options: Options) -> list[Measurement]:
    return [asyncio.run(run(queue_type, options)) for queue_type in QUEUE_TYPES]
