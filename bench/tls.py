"""The cost of TLS on the broker: produce throughput and request latency with and without TLS, the
broker a real `qmq broker` process (sync flush) and the load generator in this process.

    .venv/bin/python bench/tls.py [--seconds 10]

Cases, each against a plain broker and a TLS broker (a certificate made with `openssl` for the run):
- produce: 1 KiB messages in batches of 64, 8 batches in flight on one connection, for --seconds;
  a message counts once the broker acknowledged it (durable).
- latency: one PING at a time (the network path alone, no disk), and one single-message send at a
  time (with its fsync): p50 and p99.
- connect: a new connection with its handshake (and TLS handshake).
Figures in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qmq.net.aio_client import AsyncConnection
from qmq.net.tls import ClientTLS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.broker import free_port  # noqa: E402
from tests.support.tls import make_certs  # noqa: E402

HOST = "127.0.0.1"
BATCH = 64
IN_FLIGHT = 8
PAYLOAD = b"x" * 1024
LATENCY_SAMPLES = 2000
CONNECT_SAMPLES = 200


def start_broker(work: Path, name: str, tls_args: list[str]) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = open(work / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(
        [sys.executable, "-m", "qmq", "broker", "--port", str(port), "--data-dir", str(work / name), *tls_args],
        stdout=log,
        stderr=log,
        cwd=ROOT,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)},
    )
    log.close()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((HOST, port), timeout=0.5):
                return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError("the broker did not start")


async def produce(port: int, tls, seconds: float) -> float:
    conn = await AsyncConnection.open(HOST, port, tls=tls)
    counter = 0
    stored = 0
    deadline = time.perf_counter() + seconds

    async def sender() -> None:
        nonlocal counter, stored
        while time.perf_counter() < deadline:
            messages = []
            for _ in range(BATCH):
                counter += 1
                messages.append({"id": f"m{counter}", "subject": "bench.tls", "payload": PAYLOAD})
            reply = await conn.request(100, {"messages": messages})
            stored += reply["stored"]

    started = time.perf_counter()
    await asyncio.gather(*(sender() for _ in range(IN_FLIGHT)))
    elapsed = time.perf_counter() - started
    await conn.close()
    return stored / elapsed


async def latency(port: int, tls, code: int, make_body) -> tuple[float, float]:
    conn = await AsyncConnection.open(HOST, port, tls=tls)
    samples = []
    for i in range(LATENCY_SAMPLES):
        started = time.perf_counter()
        await conn.request(code, make_body(i))
        samples.append(time.perf_counter() - started)
    await conn.close()
    q = statistics.quantiles(samples, n=100)
    return q[49] * 1000, q[98] * 1000


async def connect(port: int, tls) -> float:
    samples = []
    for _ in range(CONNECT_SAMPLES):
        started = time.perf_counter()
        conn = await AsyncConnection.open(HOST, port, tls=tls)
        samples.append(time.perf_counter() - started)
        await conn.close()
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each produce run")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qmq-bench-tls-"))
    certs = make_certs(work / "certs")
    client_tls = ClientTLS(certs.ca).context()
    procs = []
    try:
        for name, tls_args, tls in (
            ("plain", [], None),
            ("tls", ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key], client_tls),
        ):
            proc, port = start_broker(work, name, tls_args)
            procs.append(proc)
            rate = asyncio.run(produce(port, tls, args.seconds))
            ping = asyncio.run(latency(port, tls, 2, lambda i: {"i": i}))
            single = asyncio.run(
                latency(
                    port,
                    tls,
                    100,
                    lambda i: {"messages": [{"id": f"l{i}", "subject": "bench.lat", "payload": PAYLOAD}]},
                )
            )
            connect_ms = asyncio.run(connect(port, tls))
            print(
                f"{name:5}: produce {rate:,.0f} msg/s (1 KiB, batches of {BATCH}, {IN_FLIGHT} in flight); "
                f"ping p50 {ping[0]:.3f} ms p99 {ping[1]:.3f} ms; single send p50 {single[0]:.3f} ms "
                f"p99 {single[1]:.3f} ms; connect+handshake {connect_ms:.2f} ms"
            )
            proc.terminate()
            proc.wait(30)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
