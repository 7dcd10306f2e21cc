"""Hostile clients against real server processes: oversized frames before the handshake, bodies that
nest too deep, fields of the wrong type or out of range, too many connections, idle connections and
clients that never read their replies. Each must get a clear error (or be cut off) while the server
keeps its memory and keeps answering everyone else."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from pathlib import Path

import pytest

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.frame import HEADER, LENGTH, FrameDecoder, encode_frame
from qmq.protocol.limits import MAX_HANDSHAKE_FRAME_BYTES, Limits
from tests.support.broker import start_broker
from tests.support.databases import fresh_database
from tests.support.delay import start_delay_server
from tests.support.echo_server import SLEEP
from tests.support.processes import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TOKEN = "hostile-test-token"
BIG_FRAME_BYTES = 16 * 1024 * 1024 - 64  # just under the old frame limit, so an old server buffered it
ATTACKERS = 48
RSS_GROWTH_LIMIT_BYTES = 96 * 1024 * 1024  # a server's peak RSS may grow this much under the attack
LOG_LIMIT_BYTES = 1024 * 1024  # a server's whole log during the attack
DEADLINE_S = 20.0
RAW_TIMEOUT_S = 15.0


def start_echo(processes, *args: str) -> int:
    port = free_port()
    proc = processes.start(
        ["-m", "tests.support.echo_server", "--port", str(port), *args], name="echo", env={"PYTHONPATH": str(ROOT)}
    )
    wait_for_port(port, proc)
    return port


def start_meta(processes, db_url: str, *args: str):
    port = free_port()
    proc = processes.start(
        ["-m", "qmq", "meta", "--port", str(port), "--db", db_url, *args],
        name="meta",
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": ""},
    )
    wait_for_port(port, proc)
    return proc, port


def rss(pid: int, field: str = "VmRSS") -> int:
    """A process's resident memory (or its peak, VmHWM) in bytes, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


def big_pre_handshake_frame_attack(port: int) -> None:
    """Announce a frame of 16 MiB with a valid handshake header, then try to send all of it."""
    header = LENGTH.pack(BIG_FRAME_BYTES) + HEADER.pack(1, RequestCode.HANDSHAKE, 1, 0)
    chunk = b"\xc1" * (1024 * 1024)  # 0xc1: never valid msgpack
    try:
        with socket.create_connection((HOST, port), timeout=RAW_TIMEOUT_S) as sock:
            sock.sendall(header)
            sent = 0
            while sent < BIG_FRAME_BYTES - HEADER.size:
                sock.sendall(chunk)
                sent += len(chunk)
            while sock.recv(65536):
                pass
    except OSError:
        pass  # the server closed on us: that is the point


def raw_frames(port: int, data: bytes) -> list:
    """Send `data`, read until the server closes, return the frames it sent."""
    received = bytearray()
    with socket.create_connection((HOST, port), timeout=RAW_TIMEOUT_S) as sock:
        with contextlib.suppress(OSError):
            sock.sendall(data)
        while chunk := sock.recv(65536):
            received += chunk
    decoder = FrameDecoder(Limits(max_frame_bytes=2**31))
    decoder.feed(bytes(received))
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    return frames


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


# ---- before the handshake ----------------------------------------------------------------------


def test_a_frame_above_the_pre_handshake_limit_is_refused_at_its_length(processes):
    port = start_echo(processes, "--token", TOKEN)
    data = LENGTH.pack(MAX_HANDSHAKE_FRAME_BYTES + 1) + HEADER.pack(1, RequestCode.HANDSHAKE, 1, 0)
    frames = raw_frames(port, data)  # the server closes without waiting for the announced body
    assert len(frames) == 1 and frames[0].is_error and frames[0].request_id == 0
    assert frames[0].body["code"] == ErrorCode.FRAME_TOO_LARGE
    assert "before the handshake" in frames[0].body["message"]
    # A handshake of ordinary size still works, and so do big frames after it.
    with BlockingConnection.open(HOST, port, token=TOKEN) as conn:
        assert conn.request(RequestCode.PING, {"x": b"y" * 100_000}) == {"x": b"y" * 100_000}


def test_tls_bytes_to_a_plain_server_get_a_clear_error(processes):
    port = start_echo(processes)
    client_hello = bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01]) + b"\x00" * 64
    frames = raw_frames(port, client_hello)
    assert frames[0].body["code"] == ErrorCode.BAD_FRAME
    assert "looks like TLS" in frames[0].body["message"]


def test_pre_handshake_floods_leave_memory_bounded_and_others_answered(processes, pg_url, tmp_path):
    """48 pre-handshake 16 MiB frames against each of meta, broker and delay server, with a token
    set: each process's peak RSS stays bounded, its log small, and a canary keeps being answered."""
    with fresh_database(pg_url) as db_url:
        meta_proc, meta_port = start_meta(processes, db_url, "--token", TOKEN)
        broker = start_broker(processes, tmp_path / "broker", "--token", TOKEN)
        delay = start_delay_server(processes, tmp_path / "delay", "--token", TOKEN, "--broker", broker.address)
        targets = {
            "meta": (meta_proc, meta_port),
            "broker": (broker.proc, broker.port),
            "delay": (delay.proc, delay.port),
        }
        canaries = {name: BlockingConnection.open(HOST, port, token=TOKEN) for name, (_, port) in targets.items()}
        baseline = {name: rss(proc.pid) for name, (proc, _) in targets.items()}
        log_sizes = {name: Path(proc.log_path).stat().st_size for name, (proc, _) in targets.items()}
        latencies: dict[str, list[float]] = {name: [] for name in targets}
        failures: list[str] = []
        stop = threading.Event()

        def canary(name: str) -> None:
            conn = canaries[name]
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    assert conn.request(RequestCode.PING, {"n": 1}, timeout=10) == {"n": 1}
                except Exception as exc:
                    failures.append(f"{name}: {exc!r}")
                    return
                latencies[name].append(time.perf_counter() - started)
                time.sleep(0.01)

        watchers = [threading.Thread(target=canary, args=(name,)) for name in targets]
        for thread in watchers:
            thread.start()
        attackers = [
            threading.Thread(target=big_pre_handshake_frame_attack, args=(port,))
            for _, port in targets.values()
            for _ in range(ATTACKERS)
        ]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(120)
        stop.set()
        for thread in watchers:
            thread.join(30)
        for conn in canaries.values():
            conn.close()
        assert not failures
        for name, (proc, _) in targets.items():
            assert proc.poll() is None, f"{name} died"
            growth = rss(proc.pid, "VmHWM") - baseline[name]
            slowest_ms = max(latencies[name], default=0) * 1000
            print(f"{name}: peak RSS +{growth / 2**20:.1f} MiB, slowest ping {slowest_ms:.0f} ms")
            assert growth < RSS_GROWTH_LIMIT_BYTES, f"{name}'s peak RSS grew {growth / 2**20:.0f} MiB"
            logged = Path(proc.log_path).stat().st_size - log_sizes[name]
            assert logged < LOG_LIMIT_BYTES, f"{name} logged {logged} bytes"
            assert latencies[name], f"{name}'s canary got no answer"


# ---- bodies and fields ---------------------------------------------------------------------------


def refused(conn: BlockingConnection, code: int, body: dict) -> RemoteError:
    with pytest.raises(RemoteError) as info:
        conn.request(code, body)
    assert conn.request(RequestCode.PING, {"still": "open"}) == {"still": "open"}
    return info.value


def test_a_deeply_nested_consumer_is_a_bad_request_and_the_connection_stays(broker):
    with broker.connect() as conn:
        error = refused(conn, RequestCode.BROKER_PULL, {"subject": "a", "group": "g", "consumer": nested(1000)})
        assert error.code == ErrorCode.BAD_REQUEST and "deep" in error.message
        # Deep enough to be refused by the decoder, or shallow and refused by the field's check.
        error = refused(conn, RequestCode.BROKER_PULL, {"subject": "a", "group": "g", "consumer": nested(20)})
        assert error.code == ErrorCode.BAD_REQUEST and "consumer" in error.message
        error = refused(conn, RequestCode.PING, {"x": nested(40)})
        assert error.code == ErrorCode.BAD_REQUEST


@pytest.mark.parametrize(
    "body, code, words",
    [
        ({"max": -1}, ErrorCode.BAD_REQUEST, "'max'"),
        ({"max": 2**63}, ErrorCode.BAD_REQUEST, "'max'"),
        ({"max": "10"}, ErrorCode.BAD_REQUEST, "'max'"),
        ({"max": True}, ErrorCode.BAD_REQUEST, "'max'"),
        ({"wait_ms": -5}, ErrorCode.BAD_REQUEST, "'wait_ms'"),
        ({"wait_ms": 10**12}, ErrorCode.BAD_REQUEST, "'wait_ms'"),
        ({"wait_ms": 1.5}, ErrorCode.BAD_REQUEST, "'wait_ms'"),
        ({"subject": 5}, ErrorCode.BAD_REQUEST, "'subject'"),
        ({"subject": "x" * 100_000}, ErrorCode.BAD_SUBJECT, "limit"),
        ({"group": ["g"]}, ErrorCode.BAD_REQUEST, "group"),
        ({"consumer": {"a": 1}}, ErrorCode.BAD_REQUEST, "consumer"),
        ({"consumer": "c" * 1_000_000}, ErrorCode.BAD_REQUEST, "consumer"),
        ({"tags": "x"}, ErrorCode.BAD_REQUEST, "'tags'"),
        ({"pulled": [1]}, ErrorCode.BAD_REQUEST, "'pulled'"),
        ({"start": 3}, ErrorCode.BAD_REQUEST, "'start'"),
    ],
)
def test_pull_fields_of_the_wrong_type_or_range_are_bad_requests(broker, body, code, words):
    with broker.connect() as conn:
        error = refused(conn, RequestCode.BROKER_PULL, {"subject": "a", "group": "g", "consumer": "c", **body})
        assert error.code == code and words in error.message
        assert len(error.message) < 2000  # a huge field is never quoted whole


@pytest.mark.parametrize(
    "request_code, body",
    [
        (RequestCode.BROKER_ACK, {"acks": [[nested(10), "g", "c", 1]]}),
        (RequestCode.BROKER_ACK, {"acks": "x"}),
        (RequestCode.BROKER_NACK, {"nacks": [{"subject": [], "group": {}, "consumer": "c", "pull_seq": 1}]}),
        (RequestCode.BROKER_HEARTBEAT, {"consumers": [["a", "g", "c"]], "worker": "x"}),
        (RequestCode.BROKER_LEAVE, {"leaves": [[nested(10), "g", "c", 1]]}),
        (RequestCode.BROKER_LEAVE, {"leaves": [["a", "g", "c", True]]}),
        (RequestCode.BROKER_SEND, {"messages": [1, "x", None]}),
        (RequestCode.BROKER_SEND, {"messages": {"a": 1}}),
        (RequestCode.BROKER_RESET, {"subject": "a", "group": "g", "to": [1]}),
        (RequestCode.BROKER_DEAD_LIST, {"subject": "a", "group": "g", "from": -(2**63), "max": 0}),
        (RequestCode.BROKER_LOOKUP, {"id": 5}),
    ],
)
def test_other_broker_requests_with_bad_fields_are_client_errors(broker, request_code, body):
    with broker.connect() as conn:
        try:
            reply = conn.request(request_code, body)
        except RemoteError as exc:
            assert exc.code != ErrorCode.INTERNAL, exc
        else:
            assert all(r[1] != ErrorCode.INTERNAL for r in reply.get("rejected", []))
    with broker.connect() as conn:  # a new connection: the broker serves it as ever
        assert conn.request(RequestCode.PING, {}) == {}


def test_deliver_at_beyond_any_calendar_is_rejected_clearly(processes, tmp_path, broker):
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    message = {"id": "m1", "subject": "a", "payload": b"x"}
    with delay.connect() as conn:
        for deliver_at in (10**15, 2**63 - 1):
            reply = conn.request(RequestCode.DELAY_SEND, {"messages": [{**message, "deliver_at": deliver_at}]})
            assert reply["stored"] == 0
            [[_index, code, text]] = reply["rejected"]
            assert code == ErrorCode.BAD_REQUEST and "days ahead" in text
        reply = conn.request(RequestCode.DELAY_SEND, {"messages": [{**message, "deliver_at": "soon"}]})
        assert reply["rejected"][0][1] == ErrorCode.BAD_REQUEST


# ---- connections -----------------------------------------------------------------------------------


def test_connections_over_the_cap_per_address_are_refused_clearly(processes):
    port = start_echo(processes, "--max-connections-per-address", "3")
    conns = [BlockingConnection.open(HOST, port) for _ in range(3)]
    with pytest.raises(RemoteError) as info:
        BlockingConnection.open(HOST, port)
    assert info.value.code == ErrorCode.UNAVAILABLE and "per address" in info.value.message
    conns.pop().close()
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the server notices the close a moment later
        try:
            conns.append(BlockingConnection.open(HOST, port))
            break
        except RemoteError:
            assert time.monotonic() < deadline
    for conn in conns:
        assert conn.request(RequestCode.PING, {"ok": 1}) == {"ok": 1}
        conn.close()


def test_connections_over_the_server_cap_are_refused(processes):
    port = start_echo(processes, "--max-connections", "2")
    conns = [BlockingConnection.open(HOST, port) for _ in range(2)]
    with pytest.raises(RemoteError) as info:
        BlockingConnection.open(HOST, port)
    assert info.value.code == ErrorCode.UNAVAILABLE and "--max-connections" in info.value.message
    for conn in conns:
        conn.close()


def test_an_idle_connection_is_closed_but_a_long_request_keeps_it(processes):
    port = start_echo(processes, "--idle-timeout", "1")
    busy = BlockingConnection.open(HOST, port)
    assert busy.request(SLEEP, {"ms": 2500}) == {"ms": 2500}  # SLEEP: 2.5 s in flight, past the timeout
    idle = BlockingConnection.open(HOST, port)
    deadline = time.monotonic() + DEADLINE_S
    while not idle.closed:
        assert time.monotonic() < deadline, "the idle connection was never closed"
        time.sleep(0.05)
    with pytest.raises((ConnectionError, RemoteError)) as info:
        idle.request(RequestCode.PING, {})
    assert "idle" in str(info.value)
    busy.close()


def test_a_client_that_never_reads_its_replies_is_cut_off(processes):
    port = start_echo(processes, "--slow-read-timeout", "1", "--write-buffer-bytes", "65536")
    payload = b"z" * (1024 * 1024)
    with socket.create_connection((HOST, port), timeout=RAW_TIMEOUT_S) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(encode_frame(RequestCode.HANDSHAKE, 1, {"version": 1, "client_id": "slow"}))
        cut = False
        deadline = time.monotonic() + DEADLINE_S
        request_id = 2
        try:
            while time.monotonic() < deadline:  # pings of 1 MiB each, replies never read
                sock.sendall(encode_frame(RequestCode.PING, request_id, {"p": payload}))
                request_id += 1
        except TimeoutError:
            cut = False  # blocked for RAW_TIMEOUT_S: the server neither read nor cut
        except OSError:
            cut = True
        assert cut, "the server kept a client that never reads"
    with BlockingConnection.open(HOST, port) as conn:  # and it serves others
        assert conn.request(RequestCode.PING, {}) == {}
