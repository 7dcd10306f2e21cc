"""Where a message's send-to-receipt time goes through the client (issue 18's latency row).

    .venv/bin/python bench/latency_path.py                 # 1,000 msg/s for 5 s, acks on
    .venv/bin/python bench/latency_path.py --no-ack --rate 500
    .venv/bin/python bench/latency_path.py --prefetch

A real `qmq broker --flush sync`, its request handlers timed from inside (this script starts it with
a wrapper that records when each BROKER_SEND and BROKER_PULL handler starts and returns, the ids it
saw, each fsync of the message log, and the hand-offs to and from the flusher thread: when a flush
is first asked for and when the loop settles the waiters after a round); a producer process sending
one stamped 1 KiB message every 1/rate s with `AsyncClient.send_one`; a consumer in this process,
`AsyncSubscription.pull` and an ack per delivery, as bench/peers' latency case but in two processes;
uvloop in all three. Every process stamps with `time.perf_counter()`, which is CLOCK_MONOTONIC, one
clock for the whole machine, so the phases of one message line up across the processes (joined by
message id). Prints p50 and p90 of each phase, and how often the consumer's pull was already waiting
at the broker when the message came, how often the message was served ahead of the consumer's next
pull (--prefetch), and the total for each of those cases. Not run in CI; figures in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import bisect
import multiprocessing
import os
import pickle
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.broker import BrokerProcess, broker_args, free_port, install_uvloop, wait_port  # noqa: E402
from qmq.client import AsyncClient  # noqa: E402

SUBJECT = "latency.path"
STAMP = struct.Struct("!d")  # the producer's perf_counter() when it called send_one
SIZE = 1024
TRACE_ENV = "QMQ_BENCH_TRACE_OUT"


# ---- the traced broker (this file run as `python bench/latency_path.py --traced-broker ARGS`) ---------


def traced_broker(args: list[str]) -> None:
    """`qmq broker ARGS` with its send and pull handlers and the log's fsync timed; the times are
    pickled to $QMQ_BENCH_TRACE_OUT when it exits."""
    from qmq.broker import consuming, sending
    from qmq.cli import main
    from qmq.store import flush, message_log, native_flush

    trace: dict[str, list] = defaultdict(list)

    def timed(cls: type, name: str, ids: object) -> None:
        handler = getattr(cls, name)

        async def wrapper(self: object, body: dict) -> dict:
            started = time.perf_counter()
            reply = await handler(self, body)
            trace[name].append((started, time.perf_counter(), ids(body, reply)))
            return reply

        setattr(cls, name, wrapper)

    timed(sending.Sending, "send", lambda body, reply: [m["id"] for m in body["messages"]])
    timed(
        consuming.Consuming,
        "pull",
        lambda body, reply: [m["id"] for b in reply.get("batches", ()) for m in b["messages"]],
    )
    take_ahead = consuming.Consuming._take_ahead

    def traced_take_ahead(self: consuming.Consuming, pull: object, count: int) -> tuple[list[dict], int | None]:
        batches, end = take_ahead(self, pull, count)
        trace["ahead"].extend((0.0, 0.0, m["id"]) for b in batches for m in b["messages"])
        return batches, end

    consuming.Consuming._take_ahead = traced_take_ahead  # type: ignore[method-assign]
    sync = message_log.MessageLog.sync

    def timed_sync(self: message_log.MessageLog) -> int:
        started = time.perf_counter()
        end = sync(self)
        trace["fsync"].append((started, time.perf_counter(), None))
        return end

    message_log.MessageLog.sync = timed_sync  # type: ignore[method-assign]
    observe_fsyncs = native_flush.NativeFlusher._observe_fsyncs

    def traced_fsyncs(self: native_flush.NativeFlusher, fsyncs: list[tuple[float, float]]) -> None:  # the C thread's
        trace["fsync"].extend((start, start + seconds, None) for start, seconds in fsyncs)
        observe_fsyncs(self, fsyncs)

    native_flush.NativeFlusher._observe_fsyncs = traced_fsyncs  # type: ignore[method-assign]
    request, settle = flush.Flusher.request, flush._LoopWaiters.settle

    def traced_request(self: flush.Flusher, offset: int) -> None:
        if offset > self._requested and offset > self.durable_offset:  # a flush not yet asked for
            trace["flush_asked"].append((time.perf_counter(), 0.0, None))
        request(self, offset)

    def traced_settle(self: flush._LoopWaiters, durable: int, error: BaseException | None) -> None:
        trace["settled"].append((time.perf_counter(), 0.0, None))
        settle(self, durable, error)

    flush.Flusher.request = traced_request  # type: ignore[method-assign]
    flush._LoopWaiters.settle = traced_settle  # type: ignore[method-assign]

    def dump() -> None:
        with open(os.environ[TRACE_ENV], "wb") as out:
            pickle.dump(dict(trace), out)

    atexit.register(dump)
    sys.argv = ["qmq", "broker", *args]
    main()


class TracedBroker(BrokerProcess):
    """bench/broker.py's broker process, started through `traced_broker`; its times land in
    `trace_out` when it stops."""

    def __init__(self, trace_out: Path) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="qmq-bench-latency-"))
        self.port = free_port()
        command = [sys.executable, __file__, "--traced-broker", *broker_args(self.dir / "data", self.port, "sync")]
        self.proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, TRACE_ENV: str(trace_out)})
        wait_port(self.port, self.proc, 30)


# ---- the producer process and the consumer -------------------------------------------------------


def produce(port: int, rate: int, total: int) -> None:
    install_uvloop()

    async def run() -> None:
        async with AsyncClient(brokers=[f"127.0.0.1:{port}"]) as client:
            started, sends = time.perf_counter(), []
            for i in range(total):
                pause = started + i / rate - time.perf_counter()
                if pause > 0:
                    await asyncio.sleep(pause)
                body = STAMP.pack(time.perf_counter()) + bytes(SIZE - STAMP.size)
                sends.append(asyncio.ensure_future(client.send_one(SUBJECT, body, message_id=f"lp-{i:08d}")))
            await asyncio.gather(*sends)

    asyncio.run(run())


async def consume(port: int, rate: int, total: int, ack: bool, prefetch: bool) -> dict[str, tuple[float, float]]:
    """{message id: (producer stamp, receipt)}."""
    received: dict[str, tuple[float, float]] = {}
    async with AsyncClient(brokers=[f"127.0.0.1:{port}"]) as client:
        subscription = await client.subscribe(SUBJECT, "latency-path", start="earliest", prefetch=prefetch)
        await subscription.pull(1, 0)  # the group exists before the first message
        producer = multiprocessing.get_context("spawn").Process(target=produce, args=(port, rate, total))
        producer.start()
        while len(received) < total:
            batch = await subscription.pull(256, 2.5)
            now = time.perf_counter()
            for delivery in batch:
                received[delivery.id] = (STAMP.unpack_from(delivery.body)[0], now)
                if ack:
                    await subscription.ack(delivery)
        await subscription.close()
        producer.join()
    return received


# ---- the report -----------------------------------------------------------------------------------


def quantiles(values: list[float]) -> str:
    ordered = sorted(values)
    n = len(ordered)
    return f"p50 {ordered[n // 2] * 1000:6.3f}  p90 {ordered[int(n * 0.9)] * 1000:6.3f} ms"


def report(received: dict, trace: dict) -> None:
    send_at = {i: (start, end) for start, end, ids in trace["send"] for i in ids}
    pull_of = {i: (start, end) for start, end, ids in trace["pull"] for i in ids}
    served_ahead = {i for _, _, i in trace.get("ahead", ())}
    phases: dict[str, list[float]] = defaultdict(list)
    waiting = 0
    for message_id, (stamp, receipt) in received.items():
        send_start, send_end = send_at[message_id]
        pull_start, pull_end = pull_of[message_id]
        phases["producer: send_one called -> broker send handler starts"].append(send_start - stamp)
        phases["broker: send handler (append, fsync, reply)"].append(send_end - send_start)
        phases["broker: send handler starts -> the pull handing it out returns"].append(pull_end - send_start)
        phases["consumer: that pull returns at the broker -> pull() returns"].append(receipt - pull_end)
        phases["total: send_one called -> pull() returns it"].append(receipt - stamp)
        waiting += pull_start < send_start
        if pull_start < send_start:
            phases["total, the pull was waiting at the broker"].append(receipt - stamp)
        elif message_id in served_ahead:
            phases["total, served ahead (qmq/broker/ahead.py)"].append(receipt - stamp)
        else:
            phases["total, neither: taken by the next pull when it came"].append(receipt - stamp)
    for name, values in phases.items():
        print(f"{name:66s} {quantiles(values)}")
    fsyncs = [end - start for start, end, _ in trace["fsync"]]
    print(f"{'broker: fsync of the message log':66s} {quantiles(fsyncs)}")
    handed_over: list[float] = []
    settled_after: list[float] = []
    asked = sorted(t for t, _, _ in trace.get("flush_asked", ()))
    settles = sorted(t for t, _, _ in trace.get("settled", ()))
    previous_end = 0.0
    for start, end, _ in trace["fsync"]:
        i = bisect.bisect_right(asked, previous_end)  # the first flush asked for after the round before
        if i < len(asked) and asked[i] < start:
            handed_over.append(start - asked[i])
        j = bisect.bisect_left(settles, end)
        if j < len(settles):
            settled_after.append(settles[j] - end)
        previous_end = end
    if handed_over and settled_after:
        print(f"{'broker: flush asked for -> its fsync starts (the flusher thread)':66s} {quantiles(handed_over)}")
        from qmq.store.native_flush import sync_thread

        print(f"# the broker's fsync thread: {'C' if sync_thread is not None else 'Python'}")
        print(f"{'broker: fsync done -> the loop settles its waiters':66s} {quantiles(settled_after)}")
    print(
        f"# {len(received)} messages, {len(trace['pull'])} pulls, {len(fsyncs)} fsyncs; the pull was already "
        f"waiting at the broker for {100 * waiting / len(received):.0f}% of the messages, "
        f"{100 * len(served_ahead & set(received)) / len(received):.0f}% were served ahead"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=int, default=1000, help="messages per second")
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--no-ack", action="store_true", help="the consumer does not acknowledge")
    parser.add_argument("--prefetch", action="store_true", help="subscribe with prefetch=True")
    args = parser.parse_args()
    install_uvloop()  # as bench/peers runs every client
    total = int(args.rate * args.seconds)
    trace_out = Path(tempfile.mkdtemp(prefix="qmq-bench-latency-trace-")) / "trace.pickle"
    print(
        f"# {args.rate} msg/s for {args.seconds:g} s, {SIZE} B, acks {'off' if args.no_ack else 'on'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    broker = TracedBroker(trace_out)
    try:
        received = asyncio.run(consume(broker.port, args.rate, total, not args.no_ack, args.prefetch))
    finally:
        broker.stop()
    with open(trace_out, "rb") as trace:
        report(received, pickle.load(trace))
    shutil.rmtree(trace_out.parent, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--traced-broker"]:
        traced_broker(sys.argv[2:])
    else:
        main()
