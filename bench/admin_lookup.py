"""What a look-up costs (`qmq admin lookup`, the console's look-up): a broker as a real process, a
journal made long by a consumer that pulls one message at a time, and BROKER_LOOKUP timed for the
first message (whose life is read through the whole journal) and for one sent after them all (a
short read).

    .venv/bin/python bench/admin_lookup.py [--messages 20000] [--repeat 5]

A look-up reads the journal from the message's first record onwards, off the broker's event loop,
at most 200,000 journal records. Prints one line per figure; record them in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode

ROOT = Path(__file__).resolve().parents[1]
BATCH = 500  # messages per send


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        port = free_port()
        broker = subprocess.Popen(
            [sys.executable, "-m", "qmq", "broker", "--data-dir", tmp, "--port", str(port)],
            env={**os.environ, "PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": ""},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 30
            while True:
                try:
                    conn = BlockingConnection.open("127.0.0.1", port, client_id="bench", token="")
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.1)
            for first in range(0, args.messages, BATCH):
                messages = [
                    {"id": f"m{n}", "subject": "orders", "payload": b"x" * 100, "key": f"k{n}"}
                    for n in range(first, min(first + BATCH, args.messages))
                ]
                conn.request(RequestCode.BROKER_SEND, {"messages": messages}, timeout=60)
            pulled = -1
            started = time.monotonic()
            for _ in range(args.messages):  # one message per pull, acked at once: two journal records each
                body = {"subject": "orders", "group": "g", "consumer": "c", "max": 1, "wait_ms": 0,
                        "start": "earliest", "pulled": {"orders": pulled}}  # fmt: skip
                reply = conn.request(RequestCode.BROKER_PULL, body, timeout=60)
                pulled = reply["batches"][0]["first_pull"]
                conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c", pulled]]}, timeout=60)
            conn.request(RequestCode.BROKER_SEND, {"messages": [{"id": "late", "subject": "orders", "payload": b"x"}]})
            body = {
                "subject": "orders",
                "group": "g",
                "consumer": "c",
                "max": 1,
                "wait_ms": 0,
                "pulled": {"orders": pulled},
            }
            pulled = conn.request(RequestCode.BROKER_PULL, body, timeout=60)["batches"][0]["first_pull"]
            conn.request(RequestCode.BROKER_ACK, {"acks": [["orders", "g", "c", pulled]]}, timeout=60)
            journal = 2 * args.messages + 2
            print(f"setup: {args.messages} messages pulled one by one, {journal} journal records "
                  f"({time.monotonic() - started:.1f} s); {platform.processor() or platform.machine()}, "
                  f"{os.cpu_count()} cores")  # fmt: skip
            for name, message_id in (
                ("first message (the whole journal after it)", "m0"),
                ("late message (2 journal records after it)", "late"),
            ):
                times = []
                for _ in range(args.repeat):
                    t = time.perf_counter()
                    reply = conn.request(RequestCode.BROKER_LOOKUP, {"id": message_id}, timeout=120)
                    times.append(time.perf_counter() - t)
                [message] = reply["messages"]
                assert message["groups"] == {"g": "consumed"}, message["groups"]
                print(f"lookup of the {name}: median {statistics.median(times) * 1000:.1f} ms "
                      f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}) over {args.repeat}")  # fmt: skip
            conn.close()
        finally:
            broker.terminate()
            broker.wait(timeout=30)


if __name__ == "__main__":
    main()
