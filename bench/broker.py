"""Broker throughput and latency, with the broker as a real `qmq broker` process and the load generator
in this process, both on this machine (so they share its cores).

    .venv/bin/python bench/broker.py                 # every case
    .venv/bin/python bench/broker.py produce         # 1 KiB, batches of 64, sync flush
    .venv/bin/python bench/broker.py produce-single  # one message per request, pipelined, 4 connections
    .venv/bin/python bench/broker.py consume         # one group, batched pulls and prefix acks
    .venv/bin/python bench/broker.py latency         # send to receipt at 1,000 msg/s: p50/p99
    .venv/bin/python bench/broker.py client          # produce and consume through qmq.client (async, blocking)
    .venv/bin/python bench/broker.py produce --tree /tmp/before   # the broker of another checkout

Targets (issue 3): produce >= 100,000 msg/s; single-message pipelined >= 30,000 msg/s; consume >=
100,000 msg/s; end-to-end p99 < 5 ms at 1,000 msg/s. A message counts as produced once the broker
acknowledged it (durable, with sync flush), as consumed once its ack was answered. Prints one line
per case, with the broker process's CPU time per 1,000 messages: on a machine shared with other work
the rate moves with the load, the CPU cost much less, so compare the CPU figure of a change (`--tree`
runs the broker of another checkout, before and after in one sitting). Record the figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qmq.net.aio_client import AsyncConnection
from qmq.net.probe import accepts
from qmq.protocol.codes import RequestCode

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """Until `proc` listens on `port`; RuntimeError when it exits first or takes over `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if accepts(HOST, port):
            return
        time.sleep(0.05)  # polling a port from outside the process
    raise RuntimeError(f"nothing listened on {port}")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far."""
    return sum(cpu_split(pid))


def cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU time of process `pid` so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def install_uvloop() -> None:
    """The faster event loop, when installed (as a production deployment would have it)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass


def broker_args(data_dir: Path, port: int, flush: str) -> list[str]:
    """`qmq broker`'s options: on `port` with its store in `data_dir`, logging warnings only."""
    return ["--data-dir", str(data_dir), "--port", str(port), "--flush", flush, "-l", "WARNING"]


def broker_command(data_dir: Path, port: int, flush: str) -> list[str]:
    return [sys.executable, "-m", "qmq", "broker", *broker_args(data_dir, port, flush)]


class BrokerProcess:
    def __init__(self, flush: str, tree: Path = ROOT) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qmq-bench-broker-"))
        self.port = free_port()
        self.proc = subprocess.Popen(broker_command(self.dir / "data", self.port, flush), cwd=tree)
        wait_port(self.port, self.proc, 30)

    def cpu_ms_per_1000(self, since_s: float, messages: int) -> float:
        return (cpu_seconds(self.proc.pid) - since_s) * 1000 / messages * 1000

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        shutil.rmtree(self.dir, ignore_errors=True)


def messages(prefix: str, start: int, count: int, payload: bytes, subject: str = "bench") -> list[dict]:
    return [{"id": f"{prefix}-{start + i:012d}", "subject": subject, "payload": payload} for i in range(count)]


async def produce(
    port: int, total: int, batch: int, size: int, connections: int, inflight: int, subject: str = "bench"
) -> dict:
    """`connections` connections, each with `inflight` requests of `batch` messages in flight."""
    payload = os.urandom(size)
    conns = [await AsyncConnection.open(HOST, port, client_id=f"bench-{i}") for i in range(connections)]
    next_index = 0
    latencies: list[float] = []

    async def worker(conn: AsyncConnection) -> None:
        nonlocal next_index
        while next_index < total:
            start = next_index
            next_index += batch
            body = {"messages": messages("m", start, batch, payload, subject)}
            t0 = time.perf_counter()
            reply = await conn.request(RequestCode.BROKER_SEND, body)
            latencies.append(time.perf_counter() - t0)
            assert reply["stored"] == batch, reply

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns for _ in range(inflight)))
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.close()
    latencies.sort()
    return {
        "messages": next_index,
        "seconds": elapsed,
        "rate": next_index / elapsed,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


async def consume(port: int, total: int, max_pull: int, consumers: int = 2) -> dict:
    """`consumers` consumers of one group, each on its own connection, each acking the batch it got
    while its next pull is served. (One consumer id has one pull in flight: a pull says what its
    consumer has seen, so two at once would make the broker resend the first one's messages.)"""
    got = 0

    async def run(name: str) -> None:
        nonlocal got
        conn = await AsyncConnection.open(HOST, port, client_id=f"bench-{name}")
        pulled: dict[str, int] = {}
        ack_task = None
        while got < total:
            reply = await conn.request(
                RequestCode.BROKER_PULL,
                {
                    "subject": "bench",
                    "group": "bench",
                    "consumer": name,
                    "max": max_pull,
                    "wait_ms": 200,
                    "start": "earliest",
                    "pulled": pulled,
                },
            )
            acks = []
            for b in reply["batches"]:
                last = b["first_pull"] + len(b["messages"]) - 1
                pulled[b["subject"]] = last
                got += len(b["messages"])
                acks.append([b["subject"], b["group"], name, last])
            if ack_task is not None:
                await ack_task
            if acks:
                ack_task = asyncio.create_task(conn.request(RequestCode.BROKER_ACK, {"acks": acks}))
        if ack_task is not None:
            await ack_task
        await conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(run(f"c{i}") for i in range(consumers)))
    elapsed = time.perf_counter() - t0
    return {"messages": got, "seconds": elapsed, "rate": got / elapsed}


async def latency(port: int, rate: int, seconds: float, size: int) -> dict:
    """Send one message every 1/rate s; a long-polling consumer records when each arrives."""
    producer = await AsyncConnection.open(HOST, port, client_id="bench-producer")
    consumer = await AsyncConnection.open(HOST, port, client_id="bench-consumer")
    payload = os.urandom(size)
    await consumer.request(RequestCode.BROKER_PULL, {"subject": "lat", "group": "lat", "consumer": "c", "wait_ms": 0})
    total = int(rate * seconds)
    sent_at: dict[str, float] = {}
    delays: list[float] = []
    pulled: dict[str, int] = {}

    acks: list[asyncio.Task] = []

    async def receive() -> None:
        while len(delays) < total:
            reply = await consumer.request(
                RequestCode.BROKER_PULL,
                {"subject": "lat", "group": "lat", "consumer": "c", "max": 256, "wait_ms": 2500, "pulled": pulled},
            )
            now = time.perf_counter()
            ranges = []
            for b in reply["batches"]:
                for m in b["messages"]:
                    delays.append(now - sent_at[m["id"]])
                last = b["first_pull"] + len(b["messages"]) - 1
                pulled[b["subject"]] = last
                ranges.append([b["subject"], b["group"], "c", last])
            if ranges:
                acks.append(asyncio.create_task(consumer.request(RequestCode.BROKER_ACK, {"acks": ranges})))

    receiver = asyncio.create_task(receive())
    t0 = time.perf_counter()
    sends = []
    for i in range(total):
        due = t0 + i / rate
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        message_id = f"lat-{i:09d}"
        sent_at[message_id] = time.perf_counter()
        sends.append(
            asyncio.create_task(
                producer.request(
                    RequestCode.BROKER_SEND, {"messages": [{"id": message_id, "subject": "lat", "payload": payload}]}
                )
            )
        )
    await asyncio.gather(*sends)
    await asyncio.wait_for(receiver, 30)
    await asyncio.gather(*acks)
    await producer.close()
    await consumer.close()
    delays.sort()
    return {
        "messages": len(delays),
        "p50_ms": delays[len(delays) // 2] * 1000,
        "p99_ms": delays[int(len(delays) * 0.99)] * 1000,
        "max_ms": delays[-1] * 1000,
    }


async def client_produce(port: int, total: int, batch: int, size: int, inflight: int) -> dict:
    """The same workload through the client library (`AsyncClient.send`: envelopes, UUIDv7 ids,
    per-message results), `inflight` send() calls of `batch` messages at once."""
    from qmq.client import AsyncClient, OutgoingMessage

    body = os.urandom(size)
    sent = 0
    async with AsyncClient(brokers=[f"{HOST}:{port}"]) as client:

        async def worker() -> None:
            nonlocal sent
            while sent < total:
                sent += batch
                results = await client.send([OutgoingMessage("bench", body) for _ in range(batch)])
                assert all(r.ok for r in results), results[0]

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(inflight)))
        elapsed = time.perf_counter() - t0
    return {"messages": sent, "seconds": elapsed, "rate": sent / elapsed}


async def client_consume(port: int, total: int, max_pull: int, prefetch: bool = False) -> dict:
    """Consume through the client library: one subscription, pull, ack each delivery (acks batched);
    `prefetch`: the subscription's next pull goes out while this one's deliveries are handled."""
    from qmq.client import AsyncClient

    got = 0
    async with AsyncClient(brokers=[f"{HOST}:{port}"]) as client:
        subscription = await client.subscribe(
            "bench", f"bench-client-{prefetch}-{time.monotonic_ns()}", start="earliest", prefetch=prefetch
        )
        t0 = time.perf_counter()
        while got < total:
            for delivery in await subscription.pull(max_pull, 1.0):
                await subscription.ack(delivery)
                got += 1
        await subscription.close()
        elapsed = time.perf_counter() - t0
    return {"messages": got, "seconds": elapsed, "rate": got / elapsed}


def blocking_produce(port: int, total: int, batch: int, size: int, threads: int) -> dict:
    """The same workload through the blocking client (`Client.send`), `threads` threads each sending
    batches of `batch` messages."""
    import threading

    from qmq.client import Client, OutgoingMessage

    body = os.urandom(size)
    sent = 0
    lock = threading.Lock()
    with Client(brokers=[f"{HOST}:{port}"]) as client:

        def worker() -> None:
            nonlocal sent
            while True:
                with lock:
                    if sent >= total:
                        return
                    sent += batch
                results = client.send([OutgoingMessage("bench", body) for _ in range(batch)])
                assert all(r.ok for r in results), results[0]

        t0 = time.perf_counter()
        workers = [threading.Thread(target=worker) for _ in range(threads)]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        elapsed = time.perf_counter() - t0
    return {"messages": sent, "seconds": elapsed, "rate": sent / elapsed}


def blocking_consume(port: int, total: int, max_pull: int) -> dict:
    """Consume through the blocking client: one `Subscription`, pull, ack each delivery."""
    from qmq.client import Client

    got = 0
    with Client(brokers=[f"{HOST}:{port}"]) as client:
        subscription = client.subscribe("bench", "bench-blocking", start="earliest")
        t0 = time.perf_counter()
        while got < total:
            for delivery in subscription.pull(max_pull, 1.0):
                subscription.ack(delivery)
                got += 1
        subscription.close()
        elapsed = time.perf_counter() - t0
    return {"messages": got, "seconds": elapsed, "rate": got / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "case", nargs="?", default="all", choices=["all", "produce", "produce-single", "consume", "latency", "client"]
    )
    parser.add_argument("--flush", default="sync", choices=["sync", "async"])
    parser.add_argument("--messages", type=int, default=300_000)
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--tree", type=Path, default=ROOT, help="run the broker of this checkout")
    args = parser.parse_args()
    install_uvloop()
    print(
        f"# {platform.node()} {os.cpu_count()} cores, python {platform.python_version()}, flush {args.flush}, "
        f"{args.size} B messages, broker from {args.tree}, load average {os.getloadavg()[0]:.2f}"
    )
    cases = ["produce", "produce-single", "consume", "latency", "client"] if args.case == "all" else [args.case]
    for case in cases:
        broker = BrokerProcess(args.flush, args.tree)
        try:
            cpu = cpu_seconds(broker.proc.pid)
            if case == "produce":
                r = asyncio.run(produce(broker.port, args.messages, 64, args.size, connections=2, inflight=4))
                print(
                    f"produce        batch 64, 2 conns x 4 in flight: {r['rate']:>9,.0f} msg/s "
                    f"(batch p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; "
                    f"broker CPU {broker.cpu_ms_per_1000(cpu, r['messages']):.1f} ms per 1,000)"
                )
            elif case == "produce-single":
                n = min(args.messages, 100_000)
                r = asyncio.run(produce(broker.port, n, 1, args.size, connections=4, inflight=64))
                print(
                    f"produce-single 1 per request, 4 conns x 64 in flight: {r['rate']:>9,.0f} msg/s "
                    f"(p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms; "
                    f"broker CPU {broker.cpu_ms_per_1000(cpu, r['messages']):.1f} ms per 1,000)"
                )
            elif case == "consume":
                asyncio.run(produce(broker.port, args.messages, 64, args.size, connections=2, inflight=4))
                cpu = cpu_seconds(broker.proc.pid)
                r = asyncio.run(consume(broker.port, args.messages, 1024))
                print(
                    f"consume        one group, 2 consumers, pulls of up to 1024: {r['rate']:>9,.0f} msg/s "
                    f"(broker CPU {broker.cpu_ms_per_1000(cpu, r['messages']):.1f} ms per 1,000)"
                )
            elif case == "latency":
                r = asyncio.run(latency(broker.port, 1000, 10, args.size))
                print(
                    f"latency        1,000 msg/s for 10 s: p50 {r['p50_ms']:.2f} ms, p99 {r['p99_ms']:.2f} ms, "
                    f"max {r['max_ms']:.2f} ms"
                )
            elif case == "client":
                for inflight in (8, 32):
                    r = asyncio.run(client_produce(broker.port, args.messages, 64, args.size, inflight=inflight))
                    print(
                        f"client send    AsyncClient.send, batch 64, {inflight:>2} in flight: {r['rate']:>9,.0f} msg/s"
                    )
                for prefetch in (False, True):
                    r = asyncio.run(client_consume(broker.port, args.messages, 1024, prefetch))
                    how = "prefetch" if prefetch else "        "
                    print(f"client consume AsyncSubscription pull + ack each {how}: {r['rate']:>9,.0f} msg/s")
                for threads in (8, 32):
                    r = blocking_produce(broker.port, args.messages, 64, args.size, threads=threads)
                    print(
                        f"client send    Client.send, batch 64, {threads:>2} threads:        {r['rate']:>9,.0f} msg/s"
                    )
                r = blocking_consume(broker.port, args.messages, 1024)
                print(f"client consume Subscription pull + ack each:           {r['rate']:>9,.0f} msg/s")
        finally:
            broker.stop()


if __name__ == "__main__":
    main()
