"""The network layer against a real server process (tests/support/echo_server.py): both clients,
pipelining, the token, misbehaving clients, and a server that dies under its clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from qmq.net.aio_client import AsyncConnection
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Connection, Role
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.frame import HEADER, LENGTH, Flags, Frame, FrameDecoder, encode_frame
from qmq.protocol.limits import Limits
from tests.support.echo_server import CRASH, FAIL, SIGNAL, SLEEP, WAIT
from tests.support.processes import wait_for_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
PROMPT_S = 5.0  # "promptly": how long a dead connection may take to fail its waiters
RAW_TIMEOUT_S = 15.0  # a raw socket never waits longer than this for the server


def start_echo(processes, port: int, *args: str):
    proc = processes.start(
        ["-m", "tests.support.echo_server", "--port", str(port), *args],
        name="echo",
        env={"PYTHONPATH": str(ROOT)},
    )
    wait_for_port(port, proc)
    return proc


@pytest.fixture
def echo(processes, port):
    """A running echo server without a token; yields its port."""
    start_echo(processes, port)
    return port


def raw_exchange(port: int, data: bytes) -> list[Frame]:
    """Send `data` on a raw socket, read until the server closes, return the frames it sent."""
    received = bytearray()
    with socket.create_connection((HOST, port), timeout=RAW_TIMEOUT_S) as sock:
        sock.sendall(data)
        while chunk := sock.recv(65536):  # a timeout here (no close from the server) fails the test
            received += chunk
    decoder = FrameDecoder()
    decoder.feed(bytes(received))
    frames = []
    while (frame := decoder.next_frame()) is not None:
        frames.append(frame)
    assert decoder.buffered_bytes == 0
    return frames


def good_handshake() -> bytes:
    return Connection(Role.CLIENT, client_id="raw").start_handshake()[1]


def assert_connection_error_frame(frame: Frame, code: ErrorCode) -> None:
    assert frame.flags == Flags.RESPONSE | Flags.ERROR
    assert frame.request_id == 0
    assert frame.body is not None and frame.body["code"] == code, frame.body


# -- both clients, basic behaviour ----------------------------------------------------------------------


def test_blocking_client_requests_errors_and_timeouts(echo) -> None:
    with BlockingConnection.open(HOST, echo, client_id="blocking-test") as conn:
        assert conn.server_info["version"] == 1
        assert conn.request(RequestCode.PING, {"a": [1, "b", b"c"], "n": None}) == {"a": [1, "b", b"c"], "n": None}
        assert conn.request(RequestCode.PING) == {}
        refusals = [(FAIL, ErrorCode.BAD_REQUEST), (CRASH, ErrorCode.INTERNAL), (9999, ErrorCode.UNKNOWN_REQUEST)]
        for code, error in refusals:
            with pytest.raises(RemoteError) as info:
                conn.request(code, {})
            assert info.value.code == error
        with pytest.raises(TimeoutError):
            conn.request(SLEEP, {"ms": 300}, timeout=0.05)
        # The late reply to the abandoned request is dropped quietly; the connection goes on.
        assert conn.request(SLEEP, {"ms": 400, "i": 2}) == {"ms": 400, "i": 2}
        conn.send_oneway(CRASH, {})  # no reply, not even the error
        assert conn.request(RequestCode.PING, {"after": "oneway"}) == {"after": "oneway"}
    with pytest.raises(ConnectionError):
        conn.request(RequestCode.PING, {})


def test_async_client_requests_errors_and_timeouts(echo) -> None:
    async def scenario() -> None:
        async with await AsyncConnection.open(HOST, echo, client_id="async-test") as conn:
            assert conn.server_info["version"] == 1
            assert await conn.request(RequestCode.PING, {"x": 1.5}) == {"x": 1.5}
            with pytest.raises(RemoteError) as info:
                await conn.request(FAIL, {})
            assert info.value.code == ErrorCode.BAD_REQUEST and info.value.message == "asked to fail"
            with pytest.raises(TimeoutError):
                await conn.request(SLEEP, {"ms": 300}, timeout=0.05)
            assert await conn.request(SLEEP, {"ms": 400}) == {"ms": 400}
            await conn.send_oneway(FAIL, {})
            assert await conn.request(RequestCode.PING, {}) == {}
        with pytest.raises(ConnectionError):
            await conn.request(RequestCode.PING, {})

    asyncio.run(scenario())


def test_async_start_writes_the_request_before_it_returns(echo) -> None:
    """`start` sends at once, so a request started and not awaited is served while this thread is
    busy elsewhere (here: a blocking connection's WAIT returns only once the started SIGNAL is in);
    its outcomes are those of `request`, the timeout included."""

    async def scenario() -> None:
        conn = await AsyncConnection.open(HOST, echo)
        started = conn.start(SIGNAL, {"key": "k-start"})
        with BlockingConnection.open(HOST, echo) as blocking:  # the event loop does not run meanwhile
            assert blocking.request(WAIT, {"key": "k-start"}, timeout=PROMPT_S) == {"key": "k-start"}
        assert await started == {"key": "k-start"}
        late = conn.start(SLEEP, {"ms": 300}, timeout=0.05)
        with pytest.raises(TimeoutError, match="no reply"):
            await late
        assert await conn.request(RequestCode.PING, {"after": 1}) == {"after": 1}
        await conn.close()
        with pytest.raises(ConnectionError):
            conn.start(RequestCode.PING, {})

    asyncio.run(scenario())


# -- pipelining -----------------------------------------------------------------------------------------


def test_async_pipelining_replies_out_of_order_and_many_in_flight(echo) -> None:
    async def scenario() -> None:
        conn = await AsyncConnection.open(HOST, echo)
        # WAIT is answered only after the SIGNAL sent behind it on the same connection: the server
        # handles both at once and the replies come back in the opposite order.
        waiting = asyncio.create_task(conn.request(WAIT, {"key": "k1"}))
        assert await conn.request(SIGNAL, {"key": "k1"}) == {"key": "k1"}
        assert await waiting == {"key": "k1"}

        # More requests than the server's per-connection cap (1024), each matched to its own reply.
        bodies = [{"n": n, "ms": n % 7} for n in range(3000)]
        codes = [SLEEP if n % 2 else RequestCode.PING for n in range(len(bodies))]
        replies = await asyncio.gather(*(conn.request(code, body) for code, body in zip(codes, bodies, strict=True)))
        assert replies == bodies
        await conn.close()

    asyncio.run(scenario())


def test_threads_share_one_blocking_connection(echo) -> None:
    conn = BlockingConnection.open(HOST, echo)
    waiter_done = threading.Event()

    def wait_for_signal() -> dict:
        reply = conn.request(WAIT, {"key": "k2"})
        waiter_done.set()
        return reply

    def ping_many(thread: int) -> None:
        for n in range(200):
            body = {"thread": thread, "n": n, "pad": "x" * (n * 37 % 500)}
            assert conn.request(SLEEP if n % 10 == 0 else RequestCode.PING, {**body, "ms": 1}) == {**body, "ms": 1}

    with ThreadPoolExecutor(max_workers=17) as pool:
        waiting = pool.submit(wait_for_signal)
        workers = [pool.submit(ping_many, t) for t in range(16)]
        for worker in workers:
            worker.result()
        assert not waiter_done.is_set()  # 3200 replies went past the WAIT still in flight
        assert conn.request(SIGNAL, {"key": "k2"}) == {"key": "k2"}
        assert waiting.result(timeout=PROMPT_S) == {"key": "k2"}
    conn.close()


# -- the token ------------------------------------------------------------------------------------------


def test_a_server_with_a_token_refuses_clients_without_it(processes, port, monkeypatch) -> None:
    start_echo(processes, port, "--token", "s3cret")
    monkeypatch.delenv("QMQ_TOKEN", raising=False)
    for token in [None, "wrong", "s3cret "]:
        with pytest.raises(RemoteError) as info:
            BlockingConnection.open(HOST, port, token=token)
        assert info.value.code == ErrorCode.UNAUTHORIZED

    async def async_refused() -> int:
        with pytest.raises(RemoteError) as info:
            await AsyncConnection.open(HOST, port, token="wrong")
        return info.value.code

    assert asyncio.run(async_refused()) == ErrorCode.UNAUTHORIZED

    # The refusal is an error frame, then the server closes the connection.
    frames = raw_exchange(port, good_handshake() + encode_frame(RequestCode.PING, 2, {}))
    assert len(frames) == 1
    assert_connection_error_frame(frames[0], ErrorCode.UNAUTHORIZED)

    with BlockingConnection.open(HOST, port, token="s3cret") as conn:
        assert conn.request(RequestCode.PING, {"ok": True}) == {"ok": True}
    monkeypatch.setenv("QMQ_TOKEN", "s3cret")  # the default for both clients

    async def async_ok() -> dict:
        async with await AsyncConnection.open(HOST, port) as conn:
            return await conn.request(RequestCode.PING, {"env": True})

    assert asyncio.run(async_ok()) == {"env": True}
    with BlockingConnection.open(HOST, port) as conn:
        assert conn.request(RequestCode.PING, {"env": True}) == {"env": True}


# -- misbehaving clients --------------------------------------------------------------------------------


def bad_body_frame() -> bytes:
    payload = b"\x81\xa1a\xc1"  # a map whose value is the one byte msgpack never uses
    return LENGTH.pack(HEADER.size + len(payload)) + HEADER.pack(1, RequestCode.PING, 2, 0) + payload


@pytest.mark.parametrize(
    ("data", "code", "after_handshake"),
    [
        (b"GET / HTTP/1.1\r\nHost: qmq\r\n\r\n", ErrorCode.FRAME_TOO_LARGE, False),  # length "GET " = 1.2 GB
        (b"\x00\x00\x00\x05hello world", ErrorCode.BAD_FRAME, False),  # length shorter than a header
        (LENGTH.pack(2**32 - 1), ErrorCode.FRAME_TOO_LARGE, False),
        (LENGTH.pack(20) + HEADER.pack(7, 2, 1, 0) + b"\xc0" * 11, ErrorCode.UNSUPPORTED_VERSION, False),
        (encode_frame(RequestCode.PING, 1, {}), ErrorCode.HANDSHAKE_REQUIRED, False),
        (bad_body_frame(), ErrorCode.BAD_BODY, True),
        (LENGTH.pack(HEADER.size + 1) + HEADER.pack(1, 2, 3, 0x40) + b"\xc0", ErrorCode.BAD_FRAME, True),
        (encode_frame(2, 2, {"big": b"x" * 70_000}, limits=Limits(2**20)), ErrorCode.FRAME_TOO_LARGE, True),
    ],
)
def test_a_bad_client_is_closed_and_the_others_keep_working(
    processes, port, data: bytes, code: ErrorCode, after_handshake: bool
) -> None:
    proc = start_echo(processes, port, "--max-frame-bytes", "65536")
    with BlockingConnection.open(HOST, port, client_id="bystander") as bystander:
        assert bystander.request(RequestCode.PING, {"before": 1}) == {"before": 1}
        frames = raw_exchange(port, (good_handshake() if after_handshake else b"") + data)
        if after_handshake:
            assert frames[0].request_id == 1 and frames[0].flags == Flags.RESPONSE  # the handshake reply
        assert_connection_error_frame(frames[-1], code)
        assert bystander.request(RequestCode.PING, {"after": 1}) == {"after": 1}
    assert code.name in proc.log_path.read_text()  # logged before the error frame was sent


@pytest.mark.parametrize("data", [b"", LENGTH.pack(100) + HEADER.pack(1, 1, 1, 0)], ids=["silent", "half-frame"])
def test_a_client_that_never_completes_a_handshake_is_closed(processes, port, data: bytes) -> None:
    start_echo(processes, port, "--handshake-timeout", "0.3")
    started = time.monotonic()
    (frame,) = raw_exchange(port, data)
    assert_connection_error_frame(frame, ErrorCode.HANDSHAKE_REQUIRED)
    assert 0.3 <= time.monotonic() - started < PROMPT_S


def test_a_request_over_the_servers_limit_fails_and_closes_only_that_connection(processes, port) -> None:
    start_echo(processes, port, "--max-frame-bytes", "65536")
    with BlockingConnection.open(HOST, port) as other, BlockingConnection.open(HOST, port) as conn:
        with pytest.raises(RemoteError) as info:
            conn.request(RequestCode.PING, {"big": b"x" * 100_000})
        assert info.value.code == ErrorCode.FRAME_TOO_LARGE
        with pytest.raises(ConnectionError):
            conn.request(RequestCode.PING, {})
        assert other.request(RequestCode.PING, {"still": "here"}) == {"still": "here"}


# -- the server goes away -------------------------------------------------------------------------------


def test_pending_requests_fail_promptly_when_the_server_is_killed(processes, port) -> None:
    proc = start_echo(processes, port)
    blocking = BlockingConnection.open(HOST, port)

    async def scenario() -> None:
        conn = await AsyncConnection.open(HOST, port)
        with ThreadPoolExecutor(max_workers=4) as pool:
            stuck = [pool.submit(blocking.request, WAIT, {"key": f"never-{n}"}, timeout=120) for n in range(4)]
            pending = [asyncio.create_task(conn.request(WAIT, {"key": "never"}, timeout=120)) for _ in range(4)]
            # PING answered means the WAITs sent before it on each connection are at the server.
            assert blocking.request(RequestCode.PING, {}) == {}
            assert await conn.request(RequestCode.PING, {}) == {}

            await asyncio.to_thread(processes.kill, proc)  # SIGKILL: no goodbye, just a closed socket
            started = time.monotonic()
            for task in pending:
                with pytest.raises(ConnectionError):
                    await asyncio.wait_for(task, PROMPT_S)
            for future in stuck:
                with pytest.raises(ConnectionError):
                    future.result(timeout=PROMPT_S)
            assert time.monotonic() - started < PROMPT_S
        with pytest.raises(ConnectionError):
            await conn.request(RequestCode.PING, {})
        await conn.close()

    asyncio.run(scenario())
    with pytest.raises(ConnectionError):
        blocking.request(RequestCode.PING, {})
    blocking.close()

    # A restarted server on the same port takes new connections; old ones stay dead.
    start_echo(processes, port)
    with BlockingConnection.open(HOST, port) as conn:
        assert conn.request(RequestCode.PING, {"again": 1}) == {"again": 1}


def test_a_server_closing_cleanly_tells_its_clients(processes, port) -> None:
    proc = start_echo(processes, port)
    conn = BlockingConnection.open(HOST, port)
    with ThreadPoolExecutor(max_workers=1) as pool:
        stuck = pool.submit(conn.request, WAIT, {"key": "never"}, timeout=120)
        assert conn.request(RequestCode.PING, {}) == {}
        proc.terminate()  # SIGTERM: the server closes every connection with UNAVAILABLE
        with pytest.raises(RemoteError) as info:
            stuck.result(timeout=PROMPT_S)
        assert info.value.code == ErrorCode.UNAVAILABLE
    assert proc.wait(timeout=PROMPT_S) == 0
    with pytest.raises(ConnectionError):
        conn.request(RequestCode.PING, {})
    conn.close()
    assert "server shutting down" in proc.log_path.read_text()
