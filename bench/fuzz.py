"""Fuzzing of the three servers over real sockets: mutations of valid frames against a `qmq meta`, a
`qmq broker` and a `qmq delay-server` process, while one canary client per server sends a valid
request every few milliseconds and measures how long the answer takes.

    .venv/bin/python bench/fuzz.py                      # 100,000 frames (about a third per server)
    .venv/bin/python bench/fuzz.py --frames 2000 --seed 7

The valid frames are what the clients send (handshake, send, pull, ack, nack, heartbeat, admin
requests, registration, routes, delayed sends, cancels); each fuzzed frame is one of them mutated:
a field replaced by a value of another type or out of range (huge and negative integers, long
strings, deep nesting, bytes, floats, maps), a field dropped or added, or bytes of the encoded frame
flipped, inserted, cut or its length changed. A fuzzing connection that the server closes (it broke
the protocol) is reopened. Failure, and exit status 1: an INTERNAL answer, a server process that
dies, or a canary request that fails or waits more than CANARY_TIMEOUT_S. Prints the frames per
second, the answers by error code and the canaries' p50/p99 latency during the run (figures in
docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

from qmq.net.aio_client import AsyncConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode
from qmq.protocol.frame import HEADER, LENGTH, FrameDecoder, encode_frame
from qmq.protocol.limits import Limits

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
CONNECTIONS_PER_SERVER = 4
PIPELINE = 16  # fuzzed frames written before waiting for the answers to catch up
ANSWER_WAIT_S = 2.0  # how long a fuzzing connection waits for a batch's answers before moving on
CLOSE_WAIT_S = 0.3  # how long a connection ending on a mangled frame waits for the server's answer
MANGLED_SHARE = 0.3  # of the batches, the share that ends with a frame whose bytes are mangled
CANARY_INTERVAL_S = 0.005
CANARY_TIMEOUT_S = 5.0
READY_TIMEOUT_S = 30.0
ANY_LIMITS = Limits(max_frame_bytes=2**31)


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def wait_for_port(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before listening")
        with contextlib.suppress(OSError), socket.create_connection((HOST, port), timeout=0.5):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port}")


# ---- the valid frames ----------------------------------------------------------------------------


def message(i: int, **extra: Any) -> dict[str, Any]:
    return {"id": f"fuzz-{i}-{uuid.uuid4().hex[:8]}", "subject": "fuzz.a", "payload": b"x" * 16, "tags": ["t"], **extra}


def valid_requests(kind: str) -> list[tuple[int, dict[str, Any]]]:
    """Bodies a client sends to a server of `kind`, as (code, body)."""
    now_ms = int(time.time() * 1000)
    if kind == "meta":
        return [
            (RequestCode.META_ROUTE, {"subject": "fuzz.a", "create": True}),
            (RequestCode.META_ROUTE, {"subject": "fuzz.b", "create": False}),
            (RequestCode.META_HEARTBEAT, {"kind": "broker", "group": "fuzz", "address": "127.0.0.1:1"}),
            (RequestCode.META_REGISTER, {"kind": "delay", "address": "127.0.0.1:2"}),
            (RequestCode.META_SET_READ_ONLY, {"group": "fuzz", "read_only": False}),
            (RequestCode.META_LIST, {}),
            (RequestCode.META_UNREGISTER, {"address": "127.0.0.1:3"}),
            (RequestCode.PING, {"x": 1}),
        ]
    if kind == "delay":
        return [
            (RequestCode.DELAY_SEND, {"messages": [message(i, deliver_at=now_ms + 3_600_000) for i in range(3)]}),
            (RequestCode.DELAY_CANCEL, {"ids": ["fuzz-1", "fuzz-2"]}),
            (RequestCode.DELAY_STATS, {}),
            (RequestCode.DELAY_LOOKUP, {"id": "fuzz-1"}),
            (RequestCode.DELAY_LOOKUP, {"subject": "fuzz.a", "key": "k"}),
            (RequestCode.PING, {}),
        ]
    consumer = {"subject": "fuzz.a", "group": "g", "consumer": "c1"}
    return [
        (RequestCode.BROKER_SEND, {"messages": [message(i, key="k") for i in range(3)]}),
        (RequestCode.BROKER_PULL, {**consumer, "max": 16, "wait_ms": 0, "tags": [], "start": "earliest"}),
        (RequestCode.BROKER_PULL, {**consumer, "max": 4, "wait_ms": 50, "pulled": {"fuzz.a": 1}, "broadcast": False}),
        (RequestCode.BROKER_ACK, {"acks": [["fuzz.a", "g", "c1", 1]]}),
        (RequestCode.BROKER_NACK, {"nacks": [{**consumer, "pull_seq": 0, "attempt": 1, "delay_ms": 10}]}),
        (RequestCode.BROKER_HEARTBEAT, {"consumers": [["fuzz.a", "g", "c1"]], "worker": {"running": []}}),
        (RequestCode.BROKER_RESET, {"subject": "fuzz.a", "group": "g2", "to": "earliest"}),
        (RequestCode.BROKER_DEAD_LIST, {"subject": "fuzz.a", "group": "g", "from": 0, "max": 10}),
        (RequestCode.BROKER_DEAD_REDRIVE, {"subject": "fuzz.a", "group": "g", "seqs": [1]}),
        (RequestCode.BROKER_STATS, {}),
        (RequestCode.BROKER_LOOKUP, {"id": "fuzz-1"}),
        (RequestCode.BROKER_GROUP_CREATE, {"subject": "fuzz.a", "group": "g3", "to": "latest"}),
        (RequestCode.BROKER_CONSUMERS, {}),
        (RequestCode.PING, {}),
    ]


# ---- mutations ------------------------------------------------------------------------------------


def nasty_value(rng: random.Random) -> Any:
    depth = rng.choice([2, 10, 31, 33, 200])
    deep: Any = "x"
    for _ in range(depth):
        deep = [deep] if rng.random() < 0.5 else {"k": deep}
    return rng.choice(
        [
            -1,
            0,
            2**63 - 1,
            -(2**63),
            2**64 - 1,
            10**15,
            1.5,
            float("nan"),
            True,
            None,
            "",
            "x" * rng.choice([1, 65, 257, 5000, 100_000]),
            "%RETRY%a%b",
            "../../etc/passwd",
            "\u00e9\u0000\ud7ff",
            b"\x00\xff" * rng.choice([1, 1000]),
            [],
            [1, "a", None],
            {},
            {"a": 1},
            {1: 2} if rng.random() < 0.1 else {"k": "v"},
            deep,
        ]
    )


def mutate_value(value: Any, rng: random.Random, depth: int = 0) -> Any:
    """`value` with one thing changed somewhere inside it."""
    if isinstance(value, dict) and value and depth < 4 and rng.random() < 0.7:
        key = rng.choice(list(value))
        copy = dict(value)
        roll = rng.random()
        if roll < 0.15:
            del copy[key]
        elif roll < 0.25:
            copy[rng.choice(["extra", "", "x" * 300])] = nasty_value(rng)
        else:
            copy[key] = mutate_value(copy[key], rng, depth + 1)
        return copy
    if isinstance(value, list) and value and depth < 4 and rng.random() < 0.7:
        copy = list(value)
        index = rng.randrange(len(copy))
        roll = rng.random()
        if roll < 0.1:
            copy = copy * rng.choice([2, 100])
        elif roll < 0.2:
            del copy[index]
        else:
            copy[index] = mutate_value(copy[index], rng, depth + 1)
        return copy
    return nasty_value(rng)


def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
    buf = bytearray(data)
    roll = rng.random()
    if roll < 0.3:
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(len(buf))] = rng.randrange(256)
    elif roll < 0.45:
        at = rng.randrange(len(buf))
        buf[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    elif roll < 0.6:
        del buf[rng.randrange(LENGTH.size, len(buf)) :]
    elif roll < 0.75:
        LENGTH.pack_into(buf, 0, rng.choice([0, 1, 12, len(buf), 2**24, 2**32 - 1]))
    elif roll < 0.9:
        flags = rng.choice([0, 1, 2, 3, 4, 5, 8, 0xFFFF])
        HEADER.pack_into(buf, LENGTH.size, 1, rng.choice([0, 1, 2, 99, 100, 203, 300, 65535]), 7, flags)
    else:
        buf[LENGTH.size] = rng.choice([0, 2, 255])  # version
    return bytes(buf)


def body_mutated_frame(kind: str, rng: random.Random, request_id: int) -> bytes:
    """A well-framed request whose body has one thing changed: the server must answer it (with an
    error or not) and keep the connection."""
    code, body = rng.choice(valid_requests_cache[kind])
    for _ in range(10):
        try:
            return encode_frame(code, request_id, mutate_value(body, rng), limits=ANY_LIMITS)
        except (TypeError, ValueError, OverflowError):
            continue  # msgpack cannot say it (a 2**64, say): mutate again
    return encode_frame(code, request_id, body, limits=ANY_LIMITS)


def byte_mangled_frame(kind: str, rng: random.Random, request_id: int) -> bytes:
    """A valid frame with its bytes mangled: usually a protocol error that closes the connection."""
    code, body = rng.choice(valid_requests_cache[kind])
    return mutate_bytes(encode_frame(code, request_id, body, limits=ANY_LIMITS), rng)


def valid_body(body: Any) -> Any:
    return body if isinstance(body, dict) else {}


valid_requests_cache: dict[str, list[tuple[int, dict[str, Any]]]] = {}


# ---- the run ----------------------------------------------------------------------------------------


class Tally:
    def __init__(self) -> None:
        self.frames = 0
        self.answers: Counter[str] = Counter()
        self.internal: list[str] = []
        self.reconnects = 0


async def fuzz_connection(kind: str, port: int, frames: int, seed: int, token: str, tally: Tally) -> None:
    rng = random.Random(seed)
    sent = 0
    while sent < frames:
        try:
            reader, writer = await asyncio.open_connection(HOST, port)
        except OSError as exc:
            tally.internal.append(f"{kind}: cannot connect: {exc}")
            return
        handshake = encode_frame(RequestCode.HANDSHAKE, 1, {"version": 1, "client_id": f"fuzz-{seed}", "token": token})
        writer.write(handshake)
        decoder = FrameDecoder(ANY_LIMITS)
        closed = False
        counted = [0]  # answers to the current batch on this connection

        async def read_answers(
            reader: asyncio.StreamReader = reader, decoder: FrameDecoder = decoder, counted: list[int] = counted
        ) -> None:
            nonlocal closed
            try:
                while data := await reader.read(65536):
                    decoder.feed(data)
                    while (frame := decoder.next_frame()) is not None:
                        if frame.is_error and frame.body:
                            code = frame.body.get("code")
                            name = ErrorCode(code).name if code in ErrorCode._value2member_map_ else str(code)
                            tally.answers[name] += 1
                            if code == ErrorCode.INTERNAL:
                                tally.internal.append(f"{kind}: {frame.body.get('message')}")
                        else:
                            tally.answers["ok"] += 1
                        counted[0] += 1
            except Exception:  # a reply the fuzzer's decoder cannot read is the server's business
                pass
            closed = True

        reader_task = asyncio.create_task(read_answers())
        request_id = 2
        try:
            while sent < frames and not closed:
                # A batch of well-framed requests with mutated bodies, and sometimes a mangled frame
                # last (it usually ends the connection: nothing after it would be read).
                batch = min(PIPELINE, frames - sent)
                written = 0
                mangled = False
                for n in range(batch):
                    if closed or writer.is_closing():
                        break
                    mangled = n == batch - 1 and rng.random() < MANGLED_SHARE
                    maker = byte_mangled_frame if mangled else body_mutated_frame
                    writer.write(maker(kind, rng, request_id))
                    request_id += 1
                    written += 1
                sent += written
                tally.frames += written
                await writer.drain()
                deadline = time.monotonic() + ANSWER_WAIT_S
                while not closed and counted[0] < written - 1 and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
                counted[0] = 0
                if mangled:
                    # A mangled frame may announce a length the stream never reaches: everything
                    # after it would be read as its body. Start again on a new connection.
                    break
        except OSError:
            pass
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_WAIT_S):  # for the server's answer to a mangled frame
                await asyncio.shield(reader_task)
        reader_task.cancel()
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        tally.reconnects += 1


async def canary(kind: str, port: int, token: str, stop: asyncio.Event, latencies: list[float], failures: list[str]):
    conn = await AsyncConnection.open(HOST, port, token=token, client_id=f"canary-{kind}")
    code, body = {
        "meta": (RequestCode.META_ROUTE, {"subject": "canary.a", "create": True}),
        "broker": (RequestCode.BROKER_STATS, {}),
        "delay": (RequestCode.DELAY_STATS, {}),
    }[kind]
    try:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                await conn.request(code, body, timeout=CANARY_TIMEOUT_S)
            except Exception as exc:
                failures.append(f"{kind} canary: {exc!r}")
                return
            latencies.append(time.perf_counter() - started)
            await asyncio.sleep(CANARY_INTERVAL_S)
    finally:
        await conn.close()


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=100)[int(q) - 1]


async def run(ports: dict[str, int], frames: int, seed: int, token: str) -> tuple[dict[str, Tally], dict, list[str]]:
    stop = asyncio.Event()
    latencies: dict[str, list[float]] = {kind: [] for kind in ports}
    failures: list[str] = []
    canaries = [asyncio.create_task(canary(k, p, token, stop, latencies[k], failures)) for k, p in ports.items()]
    await asyncio.sleep(0.2)
    tallies = {kind: Tally() for kind in ports}
    per_connection = max(1, frames // (len(ports) * CONNECTIONS_PER_SERVER))
    started = time.perf_counter()
    await asyncio.gather(
        *(
            fuzz_connection(kind, port, per_connection, seed * 1000 + i * 10 + n, token, tallies[kind])
            for i, (kind, port) in enumerate(ports.items())
            for n in range(CONNECTIONS_PER_SERVER)
        )
    )
    elapsed = time.perf_counter() - started
    stop.set()
    await asyncio.gather(*canaries)
    return tallies, {"elapsed": elapsed, "latencies": latencies}, failures


def start(args: list[str], log_dir: Path, name: str, port: int) -> subprocess.Popen:
    log = open(log_dir / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen([sys.executable, "-m", "qmq", *args], stdout=log, stderr=log, cwd=ROOT)
    log.close()
    wait_for_port(port, proc)
    return proc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=100_000, help="fuzzed frames in all")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--pg", default=PG_ADMIN_URL, help="PostgreSQL admin URL (a database is made and dropped)")
    args = parser.parse_args(argv)
    token = "fuzz-token"
    work = Path(tempfile.mkdtemp(prefix="qmq-fuzz-"))
    db_name = f"qmq_fuzz_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.pg, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{db_name}"')
    db_url = f"{args.pg.rsplit('/', 1)[0]}/{db_name}"
    procs: dict[str, subprocess.Popen] = {}
    failed = True
    try:
        ports = {"meta": free_port(), "broker": free_port(), "delay": free_port()}
        procs["meta"] = start(
            ["meta", "--port", str(ports["meta"]), "--db", db_url, "--token", token], work, "meta", ports["meta"]
        )
        broker_dir, delay_dir = work / "broker", work / "delay"
        broker_address = f"{HOST}:{ports['broker']}"
        delay_args = ["delay-server", "--port", str(ports["delay"]), "--data-dir", str(delay_dir), "--token", token]
        delay_args += ["--broker", broker_address]
        procs["broker"] = start(
            ["broker", "--port", str(ports["broker"]), "--data-dir", str(broker_dir), "--token", token],
            work,
            "broker",
            ports["broker"],
        )
        procs["delay"] = start(
            delay_args,
            work,
            "delay",
            ports["delay"],
        )
        for kind in ports:
            valid_requests_cache[kind] = valid_requests(kind)
        tallies, timing, failures = asyncio.run(run(ports, args.frames, args.seed, token))
        for kind, proc in procs.items():
            if proc.poll() is not None:
                failures.append(f"{kind} exited with {proc.returncode}")
        total = sum(t.frames for t in tallies.values())
        rate = total / timing["elapsed"]
        print(f"fuzz: {total} frames in {timing['elapsed']:.1f} s = {rate:,.0f} frames/s (seed {args.seed})")
        for kind, tally in tallies.items():
            lat = timing["latencies"][kind]
            answers = ", ".join(f"{name} {count}" for name, count in tally.answers.most_common())
            print(
                f"  {kind:6} {tally.frames} frames ({sum(tally.answers.values())} answered), "
                f"{tally.reconnects} connections; canary {len(lat)} requests "
                f"p50 {percentile(lat, 50) * 1000:.1f} ms p99 {percentile(lat, 99) * 1000:.1f} ms; answers: {answers}"
            )
            failures.extend(tally.internal[:20])
        for failure in failures:
            print(f"FAILURE {failure}")
        print("fuzz: " + ("FAILED" if failures else "OK: no INTERNAL answer, no crash, canaries answered"))
        failed = bool(failures)
        return 1 if failed else 0
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        with psycopg.connect(args.pg, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        if failed:
            print(f"the servers' logs: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
