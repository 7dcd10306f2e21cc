"""Redis Streams at 127.0.0.1:6379 through redis-py (asyncio): XADD, XREADGROUP, XACK.

Produce: XADD pipelined 64 to a round trip, 8 pipelines outstanding (each on its own connection).
Consume: one consumer of a group, XREADGROUP COUNT 1024; the XACK of one batch goes in the same
pipeline as the next XREADGROUP. Latency: one XADD at a time; a consumer blocked in XREADGROUP
(BLOCK), XACK of what it got.

Durability: none. The Redis on this machine runs with `appendonly no` and `save ""` (read back from
CONFIG GET and printed): it keeps nothing on disk, so everything acknowledged is lost with the process.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import redis.asyncio as aioredis

from bench.peers.workload import (
    BATCH,
    CONSUME_BATCH,
    HOST,
    IN_FLIGHT,
    Measurement,
    Options,
    arrived,
    paced,
    payload,
    pipelined,
    record_receipt,
)

PORT = 6379
URL = f"redis://{HOST}:{PORT}/0"
BLOCK_MS = 2500
GROUP = "bench"


async def persistence(client: aioredis.Redis) -> tuple[str, str]:
    """(synced, durability) as the server is configured now."""
    appendonly = (await client.config_get("appendonly")).get("appendonly")
    save = (await client.config_get("save")).get("save")
    if appendonly == "no" and not save:
        return "no: in memory", 'none: appendonly no, save "" (nothing on disk; lost with the process)'
    fsync = (await client.config_get("appendfsync")).get("appendfsync")
    synced = "yes: appendfsync always" if appendonly == "yes" and fsync == "always" else "no: fsync later"
    return synced, f"appendonly {appendonly} (appendfsync {fsync}), save {save!r}"


async def consume(client: aioredis.Redis, stream: str, total: int) -> float:
    await client.xgroup_create(stream, GROUP, id="0")
    got = 0
    pending: list[bytes] = []
    started = time.perf_counter()
    while got < total:
        pipe = client.pipeline(transaction=False)
        if pending:
            pipe.xack(stream, GROUP, *pending)
        pipe.xreadgroup(GROUP, "c1", {stream: ">"}, count=CONSUME_BATCH)
        replies = await pipe.execute()
        entries = replies[-1][0][1] if replies[-1] else []
        pending = [entry_id for entry_id, _ in entries]
        got += len(pending)
    if pending:
        await client.xack(stream, GROUP, *pending)
    return total / (time.perf_counter() - started)


async def latency(client: aioredis.Redis, stream: str, options: Options) -> list[float]:
    await client.xgroup_create(stream, GROUP, id="$", mkstream=True)
    delays: list[float] = []
    total = int(options.latency_rate * options.latency_seconds)

    async def receive() -> None:
        while len(delays) < total:
            reply = await client.xreadgroup(GROUP, "c1", {stream: ">"}, count=BATCH * 4, block=BLOCK_MS)
            if not reply:
                continue
            entries = reply[0][1]
            for _, fields in entries:
                record_receipt(delays, fields[b"p"])
            await client.xack(stream, GROUP, *(entry_id for entry_id, _ in entries))

    receiver = asyncio.create_task(receive())
    producer = aioredis.Redis.from_url(URL)
    try:
        await paced(lambda body: producer.xadd(stream, {"p": body}), options)
        await arrived(delays, total)
        await receiver
    finally:
        receiver.cancel()
        await producer.aclose()
    return delays


async def run(options: Options) -> Measurement:
    client = aioredis.Redis.from_url(URL, max_connections=IN_FLIGHT + 2)
    result = Measurement(
        "Redis 7.0 Streams",
        *await persistence(client),
        f"redis-py asyncio, XADD pipelined {BATCH} x 8 outstanding; XREADGROUP COUNT "
        f"{CONSUME_BATCH}, XACK pipelined with the next read",
    )
    stream = f"qmq-peers:{uuid.uuid4().hex[:8]}"
    try:
        body = payload(options.size)

        async def send_batch(n: int) -> None:
            pipe = client.pipeline(transaction=False)
            for _ in range(n):
                pipe.xadd(stream, {"p": body})
            await pipe.execute()

        result.produce = await pipelined(send_batch, options.messages)
        result.consume = await consume(client, stream, options.messages)
        result.latency(await latency(client, stream + ":lat", options))
    finally:
        await client.delete(stream, stream + ":lat")
        await client.aclose()
    return result


def measure(options: Options) -> list[Measurement]:
    return [asyncio.run(run(options))]
