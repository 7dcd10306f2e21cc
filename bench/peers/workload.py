"""The workload every system runs, and the drivers that run it the same way on each.

Throughput: `messages` messages of `size` bytes, sent as batches of BATCH with IN_FLIGHT batches
outstanding (512 messages awaiting the server's acknowledgement at any time), then consumed from the
backlog in batches of CONSUME_BATCH. A message counts as produced once the server acknowledged it and
as consumed once its acknowledgement was sent (and, where the protocol answers acks, answered).
Latency: one message at a time at `latency_rate` msg/s for `latency_seconds`, each stamped with its
send time (wall clock, so that a worker process can read it too); a consumer already waiting records
receipt minus stamp. At a moderate rate this is the path's latency, not queueing.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

MESSAGE_SIZE = 1024  # bytes of payload
MESSAGES = 100_000
BATCH = 64  # messages per batch (or pipeline) on the producing side
IN_FLIGHT = 8  # batches outstanding at once
CONSUME_BATCH = 1024  # messages asked for at once: pull max, prefetch, COUNT, fetch batch
LATENCY_RATE = 1000  # msg/s
LATENCY_SECONDS = 10.0
LATENCY_DRAIN_S = 30.0  # how long the consumer may lag behind the last send before the case fails
FSYNC_PROBES = 200  # fdatasyncs timed before each run
HOST = "127.0.0.1"
STAMP = struct.Struct("<d")  # send time, seconds since the epoch, at the start of a latency payload


@dataclass(frozen=True)
class Options:
    messages: int = MESSAGES
    size: int = MESSAGE_SIZE
    latency_rate: int = LATENCY_RATE
    latency_seconds: float = LATENCY_SECONDS


@dataclass
class Measurement:
    """One system's figures in one run. `error` says why a system or a case was not measured."""

    system: str
    synced: str  # in a few words: is a message on disk (fsynced) when the producer is told it is stored?
    durability: str
    setup: str
    kind: str = "messages"  # or "tasks": Celery and the qmq worker, compared with each other
    produce: float | None = None  # msg/s (tasks published/s)
    consume: float | None = None  # msg/s (tasks executed/s)
    p50_ms: float | None = None
    p99_ms: float | None = None
    max_ms: float | None = None
    load: tuple[float, float, float] = field(default_factory=os.getloadavg)  # when the system's turn began
    error: str | None = None

    def latency(self, delays_ms: list[float]) -> None:
        self.p50_ms, self.p99_ms, self.max_ms = latency_figures(delays_ms)


def reachable(host: str, port: int, timeout_s: float = 2.0) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def fsync_probe(directory: str = "/tmp", count: int = FSYNC_PROBES) -> tuple[float, float]:
    """p50 and p99 ms of a 1 KiB write + fdatasync here now: how busy the shared disk is."""
    fd, path = tempfile.mkstemp(dir=directory, prefix="qmq-peers-fsync-")
    times = []
    try:
        for _ in range(count):
            os.write(fd, bytes(1024))
            started = time.perf_counter()
            os.fdatasync(fd)
            times.append((time.perf_counter() - started) * 1000)
    finally:
        os.close(fd)
        os.unlink(path)
    p50, p99, _ = latency_figures(times)
    return p50, p99


def payload(size: int) -> bytes:
    """A random payload, for throughput cases."""
    return os.urandom(size)


def stamped(size: int) -> bytes:
    """A payload of `size` bytes that starts with the time it was made."""
    return STAMP.pack(time.time()) + bytes(max(0, size - STAMP.size))


def record_receipt(delays_ms: list[float], body: bytes) -> None:
    delays_ms.append((time.time() - STAMP.unpack_from(body)[0]) * 1000)


def latency_figures(delays_ms: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max, in ms."""
    ordered = sorted(delays_ms)
    n = len(ordered)
    return ordered[n // 2], ordered[min(n - 1, int(n * 0.99))], ordered[-1]


async def pipelined(
    send_batch: Callable[[int], Awaitable[None]], total: int, batch: int = BATCH, in_flight: int = IN_FLIGHT
) -> float:
    """msg/s for `total` messages sent as batches, `in_flight` outstanding at once; `send_batch(n)`
    returns once the server acknowledged all `n`."""
    remaining = total

    async def lane() -> None:
        nonlocal remaining
        while remaining > 0:
            n = min(batch, remaining)
            remaining -= n
            await send_batch(n)

    started = time.perf_counter()
    await asyncio.gather(*(lane() for _ in range(in_flight)))
    return total / (time.perf_counter() - started)


async def paced(send_one: Callable[[bytes], Awaitable[object]], options: Options) -> int:
    """Send one stamped message every 1/rate s, each without waiting for the one before to be
    acknowledged; return once every send was acknowledged. Returns how many were sent."""
    total = int(options.latency_rate * options.latency_seconds)
    started = time.perf_counter()
    sends: list[asyncio.Task] = []
    for i in range(total):
        pause = started + i / options.latency_rate - time.perf_counter()
        if pause > 0:
            await asyncio.sleep(pause)
        sends.append(asyncio.ensure_future(send_one(stamped(options.size))))
    await asyncio.gather(*sends)
    return total


def paced_blocking(send_one: Callable[[bytes], object], options: Options) -> int:
    """`paced` for a blocking client: each send returns once the server took the message."""
    total = int(options.latency_rate * options.latency_seconds)
    started = time.perf_counter()
    for i in range(total):
        pause = started + i / options.latency_rate - time.perf_counter()
        if pause > 0:
            time.sleep(pause)
        send_one(stamped(options.size))
    return total


async def arrived(delays_ms: list[float], total: int, timeout_s: float = LATENCY_DRAIN_S) -> None:
    """Wait until the consumer recorded `total` receipts; TimeoutError naming how many came."""
    deadline = time.monotonic() + timeout_s
    while len(delays_ms) < total:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(delays_ms)} of {total} latency messages arrived")
        await asyncio.sleep(0.05)
