"""Delay server figures, with the delay server (and a broker) as real processes and the load generator
in this process, all on this machine (they share its cores).

    .venv/bin/python bench/delay.py                  # every case
    .venv/bin/python bench/delay.py pending          # schedule 1,000,000 x 1 KiB (throughput), then
                                                     # memory per pending message and restart time
    .venv/bin/python bench/delay.py spread           # scheduling 200,000 due over a year (8,760 buckets)
    .venv/bin/python bench/delay.py lateness         # 5,000 messages due per second, received by a consumer
    .venv/bin/python bench/delay.py parking          # one pass of the fire loop over the parking, with
                                                     # 100,000 subjects parked and 100,000 releases put
                                                     # off (in process)
    .venv/bin/python bench/delay.py --tree /tmp/before  # the servers of another checkout

Targets (issue 6): scheduling >= 50,000 msg/s (1 KiB, batched); 1,000,000 pending in the loaded
window cost < 64 bytes of memory per message above the baseline; 5,000 due per second with lateness
p99 < 600 ms; restart with 1,000,000 pending serving again in < 10 s. A message counts as scheduled
once the delay server acknowledged it (durable in its message log and filed into its bucket).
Memory is the server's anonymous resident memory (`RssAnon`: the page cache of its files is not
counted) after a restart has loaded every pending message into the wheel, minus that of the same
server restarted with nothing pending. Scheduling figures come with the delay server's CPU time per
1,000 messages, which moves less than the rate on a shared machine (`--tree` runs the servers of
another checkout, to compare a change before and after in one sitting). Prints one line per figure;
record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qmq.client import AsyncClient
from qmq.net.aio_client import AsyncConnection
from qmq.net.probe import accepts
from qmq.protocol.codes import RequestCode

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
MINUTE_MS = 60_000
CASES = ["pending", "spread", "lateness", "parking"]
PARKING_SUBJECTS = 100_000


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_port(port: int, proc: subprocess.Popen, timeout: float = 60.0) -> float:
    """Seconds until something accepts on `port`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode}")
        if accepts(HOST, port):
            return time.monotonic() - t0
        time.sleep(0.01)
    raise RuntimeError(f"nothing listened on {port} within {timeout} s")


class Server:
    tree = ROOT  # the checkout whose servers run

    def __init__(self, args: list[str], data_dir: Path, port: int | None = None) -> None:
        self.args, self.data_dir, self.port = args, data_dir, port or free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> float:
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "qmq",
                *self.args,
                "--data-dir",
                str(self.data_dir),
                "--port",
                str(self.port),
                "-l",
                "WARNING",
            ],
            cwd=self.tree,
        )
        return wait_port(self.port, self.proc)

    def cpu_seconds(self) -> float:
        """User and system CPU time of the process so far."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)

    def rss_anon_bytes(self) -> int:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no RssAnon in /proc status")


async def stats(port: int) -> dict:
    conn = await AsyncConnection.open(HOST, port, client_id="bench-stats")
    try:
        return await conn.request(RequestCode.DELAY_STATS, {})
    finally:
        await conn.close()


async def schedule(
    port: int,
    total: int,
    batch: int,
    size: int,
    connections: int,
    inflight: int,
    due_from_ms: int,
    due_span_ms: int,
    subject: str = "bench",
) -> dict:
    """DELAY_SEND batches of `batch` messages, due at times spread evenly over the span."""
    payload = os.urandom(size)
    conns = [await AsyncConnection.open(HOST, port, client_id=f"bench-{i}") for i in range(connections)]
    next_index = 0
    due: dict[str, int] = {}

    async def worker(conn: AsyncConnection) -> None:
        nonlocal next_index
        while next_index < total:
            start = next_index
            next_index += batch
            messages = []
            for i in range(start, min(start + batch, total)):
                message_id = f"d-{i:010d}"
                due[message_id] = due_from_ms + (i * 7919 % total) * due_span_ms // total
                messages.append(
                    {"id": message_id, "subject": subject, "payload": payload, "deliver_at": due[message_id]}
                )
            reply = await conn.request(RequestCode.DELAY_SEND, {"messages": messages}, 60)
            assert reply["stored"] == len(messages), reply

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in conns for _ in range(inflight)))
    elapsed = time.perf_counter() - t0
    for c in conns:
        await c.close()
    return {"messages": len(due), "seconds": elapsed, "rate": len(due) / elapsed, "due": due}


async def wait_stats(port: int, condition, timeout: float) -> tuple[dict, float]:
    t0 = time.monotonic()
    while True:
        try:
            s = await stats(port)
            if condition(s):
                return s, time.monotonic() - t0
        except OSError:
            pass
        if time.monotonic() - t0 > timeout:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.05)


async def case_pending(work: Path, total: int) -> None:
    server = Server(["delay-server", "--broker", "127.0.0.1:1"], work / "delay")
    try:
        await measure_pending(server, total)
    finally:
        server.kill()


async def measure_pending(server: Server, total: int) -> None:
    server.start()
    await stats(server.port)
    server.kill()
    server.start()  # the baseline takes the same path as the measure: a restart, with nothing pending
    await stats(server.port)
    time.sleep(1.0)
    baseline = server.rss_anon_bytes()
    due_from = time.time_ns() // 1_000_000 + 15 * MINUTE_MS  # inside the 30-minute load-ahead: in the wheel
    cpu = server.cpu_seconds()
    result = await schedule(server.port, total, 64, 1024, 2, 8, due_from, 5 * MINUTE_MS)
    cpu_ms = (server.cpu_seconds() - cpu) * 1e6 / result["messages"]
    print(
        f"scheduling: {result['messages']:,} x 1 KiB, batches of 64, 2 connections x 8 in flight, due over 5 min "
        f"in the loaded window: {result['rate']:,.0f} msg/s ({result['seconds']:.1f} s; "
        f"CPU {cpu_ms:.1f} ms per 1,000)",
        flush=True,
    )
    s = await stats(server.port)
    print(
        f"  after scheduling: wheel {s['wheel']:,} messages, RssAnon +{server.rss_anon_bytes() - baseline:,} "
        f"bytes (ingest garbage included)",
        flush=True,
    )
    server.kill()
    listening = server.start()
    s, loaded = await wait_stats(server.port, lambda st: st["wheel"] + st["held"] >= total, 120)
    print(
        f"restart after SIGKILL with {total:,} pending in the loaded window: serving "
        f"after {listening:.2f} s, every pending message in the wheel after {listening + loaded:.2f} s",
        flush=True,
    )
    time.sleep(1.0)
    extra = server.rss_anon_bytes() - baseline
    print(
        f"memory: {total:,} pending in the wheel: RssAnon +{extra:,} bytes over the empty server = "
        f"{extra / total:.1f} bytes/message (wheel arrays {s['wheel_bytes'] / total:.1f} bytes/message)",
        flush=True,
    )


async def case_spread(work: Path, total: int) -> None:
    server = Server(["delay-server", "--broker", "127.0.0.1:1"], work / "delay-spread")
    try:
        server.start()
        cpu = server.cpu_seconds()
        result = await schedule(
            server.port,
            total,
            64,
            1024,
            2,
            8,
            time.time_ns() // 1_000_000 + 2 * 86_400_000,
            365 * 86_400_000,
            subject="spread",
        )
        cpu_ms = (server.cpu_seconds() - cpu) * 1e6 / result["messages"]
        print(
            f"scheduling: {result['messages']:,} x 1 KiB due over the next year (8,760 hour buckets): "
            f"{result['rate']:,.0f} msg/s (CPU {cpu_ms:.1f} ms per 1,000)",
            flush=True,
        )
    finally:
        server.kill()


async def case_lateness(work: Path, rate: int, seconds: int) -> None:
    broker = Server(["broker"], work / "broker")
    server = Server(["delay-server", "--broker", f"{HOST}:{broker.port}"], work / "delay-lateness")
    try:
        broker.start()
        server.start()
        await measure_lateness(broker, server, rate, seconds)
    finally:
        server.kill()
        broker.kill()


async def measure_lateness(broker: Server, server: Server, rate: int, seconds: int) -> None:
    total = rate * seconds
    received: dict[str, int] = {}
    async with AsyncClient(brokers=[f"{HOST}:{broker.port}"]) as client:
        subscription = await client.subscribe("late", "bench", start="earliest")

        async def consume() -> None:
            while len(received) < total:
                for delivery in await subscription.pull(max=1024, wait_s=1.0):
                    received.setdefault(delivery.id, time.time_ns() // 1_000_000)
                    await subscription.ack(delivery)

        consumer = asyncio.create_task(consume())
        due_from = time.time_ns() // 1_000_000 + 20_000
        result = await schedule(server.port, total, 64, 1024, 2, 8, due_from, seconds * 1000, subject="late")
        print(
            f"  {total:,} messages scheduled in {result['seconds']:.1f} s; due from +20 s over {seconds} s", flush=True
        )
        await asyncio.wait_for(consumer, 20 + seconds + 60)
        await subscription.close()
    late = sorted(received[i] - due for i, due in result["due"].items())
    early = sum(1 for x in late if x < 0)
    print(
        f"lateness at {rate:,} due/s for {seconds} s (1 KiB, delay server -> broker -> consumer): "
        f"p50 {late[len(late) // 2]} ms, p99 {late[int(len(late) * 0.99)]} ms, max {late[-1]} ms, "
        f"{early} early",
        flush=True,
    )


def case_parking(subjects: int) -> None:
    """During and after an outage: `subjects` subjects parked, waiting for their next probe, and as
    many whose releases came too soon, put off. What one pass of the scheduler's fire loop costs the
    parking then (`due_released`, `next_release_ms`, `due_probes`, `next_probe_ms`). In this process,
    from this checkout (not `--tree`)."""
    from delay_server.parking import Parking

    parking, now_ms = Parking(), 1_000_000
    for i in range(subjects):
        put_off, waiting = f"released-{i}", f"parked-{i}"
        parking.park(put_off, [i], now_ms, now_ms)
        parking.subjects[put_off].streak = 3  # its last releases came too soon: the next one waits
        parking.release(put_off, now_ms)
        parking.park(waiting, [subjects + i], now_ms, now_ms)  # its first probe in PROBE_BACKOFF_S[0]
    passes = 200
    started = time.perf_counter()
    for k in range(passes):
        parking.due_released(now_ms + k)
        parking.next_release_ms(now_ms + k)
        parking.due_probes(now_ms + k)
        parking.next_probe_ms()
    each_ms = (time.perf_counter() - started) / passes * 1000
    print(
        f"parking: {subjects:,} subjects parked and {subjects:,} releases put off: {each_ms:.4f} ms a fire-loop pass",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("cases", nargs="*", metavar="CASE", help=f"of {', '.join(CASES)} (default: every case)")
    parser.add_argument("--pending", type=int, default=1_000_000, help="messages for the pending case")
    parser.add_argument("--rate", type=int, default=5000, help="messages due per second (lateness case)")
    parser.add_argument("--seconds", type=int, default=20, help="seconds of due messages (lateness case)")
    parser.add_argument("--tree", type=Path, default=ROOT, help="run the servers of this checkout")
    args = parser.parse_args()
    Server.tree = args.tree
    cases = args.cases or CASES
    if unknown := set(cases) - set(CASES):
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    print(
        f"{platform.python_implementation()} {platform.python_version()}, {os.cpu_count()} CPUs, servers from "
        f"{args.tree}, load average {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="qmq-bench-delay-"))
    try:
        if "pending" in cases:
            asyncio.run(case_pending(work, args.pending))
        if "spread" in cases:
            asyncio.run(case_spread(work, args.pending // 5))
        if "lateness" in cases:
            asyncio.run(case_lateness(work, args.rate, args.seconds))
        if "parking" in cases:
            case_parking(PARKING_SUBJECTS)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
