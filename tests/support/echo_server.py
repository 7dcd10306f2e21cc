"""A tiny qmq server for the network tests, run as a real process:

    python -m tests.support.echo_server --port P [--token T] [--max-frame-bytes N] [--handshake-timeout S]

PING echoes its body; SLEEP waits body["ms"] milliseconds and then echoes the body; WAIT blocks until
a SIGNAL with the same body["key"] arrives (from any connection), which proves without any timing
that pipelined requests are handled concurrently and answered out of order; FAIL raises a non-fatal
BAD_REQUEST; CRASH raises a plain exception (an INTERNAL error frame); any other code is
UNKNOWN_REQUEST. SIGTERM closes it cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from typing import Any

from qmq.net.guard import (
    IDLE_TIMEOUT_S,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_ADDRESS,
    SLOW_READ_TIMEOUT_S,
    WRITE_BUFFER_BYTES,
    NetLimits,
)
from qmq.net.server import HANDSHAKE_TIMEOUT_S, PeerInfo, serve
from qmq.protocol.codes import RequestCode
from qmq.protocol.connection import Request
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.limits import Limits

# Codes from the range reserved for tests (see qmq.protocol.codes).
SLEEP = 60001
FAIL = 60002
CRASH = 60003
WAIT = 60004
SIGNAL = 60005

_signals: dict[str, asyncio.Event] = {}


async def handle(request: Request, peer: PeerInfo) -> dict[str, Any] | None:
    if request.code == RequestCode.PING:
        return request.body
    if request.code == SLEEP:
        body = request.body or {}
        await asyncio.sleep(body.get("ms", 0) / 1000)
        return body
    if request.code in (WAIT, SIGNAL):
        body = request.body or {}
        signal_ = _signals.setdefault(str(body.get("key")), asyncio.Event())
        if request.code == WAIT:
            await signal_.wait()
        else:
            signal_.set()
        return body
    if request.code == FAIL:
        raise ProtocolError(ErrorCode.BAD_REQUEST, "asked to fail", fatal=False)
    if request.code == CRASH:
        raise RuntimeError("asked to crash")
    raise ProtocolError(ErrorCode.UNKNOWN_REQUEST, f"unknown request code {request.code}", fatal=False)


async def main(args: argparse.Namespace) -> None:
    server = await serve(
        handle,
        "127.0.0.1",
        args.port,
        token=args.token,
        limits=Limits(max_frame_bytes=args.max_frame_bytes),
        handshake_timeout_s=args.handshake_timeout,
        net_limits=NetLimits(
            max_connections=args.max_connections,
            max_connections_per_address=args.max_connections_per_address,
            idle_timeout_s=args.idle_timeout,
            slow_read_timeout_s=args.slow_read_timeout,
            write_buffer_bytes=args.write_buffer_bytes,
        ),
    )
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--token", default=None)
    parser.add_argument("--max-frame-bytes", type=int, default=Limits().max_frame_bytes)
    parser.add_argument("--handshake-timeout", type=float, default=HANDSHAKE_TIMEOUT_S, help="seconds")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    parser.add_argument("--max-connections-per-address", type=int, default=MAX_CONNECTIONS_PER_ADDRESS)
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT_S, help="seconds")
    parser.add_argument("--slow-read-timeout", type=float, default=SLOW_READ_TIMEOUT_S, help="seconds")
    parser.add_argument("--write-buffer-bytes", type=int, default=WRITE_BUFFER_BYTES)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(main(args))
