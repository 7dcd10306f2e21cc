"""The request path every server shares (qmq/net/service.py), held to its promises against real
`qmq broker`, `qmq delay-server` and `qmq meta` processes alike: an unknown request code, a field of
the wrong type and a field out of range are answered (naming the field) and the connection carries
on; a store or database that cannot take a request is answered UNAVAILABLE with the cause; every
request shows in the server's request metrics.

The broker's and the delay server's stores fail for real: the process runs under a file-size limit
(RLIMIT_FSIZE, as `prlimit --fsize`), so the message log's write past it fails with EFBIG, as a full
disk would. The meta server's database is taken away (PostgreSQL stops accepting connections).
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.protocol.limits import MAX_GROUP_LEN, MAX_PULL_MESSAGES
from qmq.store.store import LogStore, Message
from tests.support.broker import HOST, ROOT
from tests.support.databases import fresh_database, set_connections_allowed
from tests.support.processes import free_port, wait_for_port
from tests.test_broker_protocol import sample, scrape

FILE_SIZE_LIMIT = 2 * 1024 * 1024  # bytes any file of the broker or delay server may grow to
BIG_PAYLOAD = b"x" * (512 * 1024)  # four of these take the message log past the limit
HOUR_MS = 3_600_000
UNKNOWN_CODE = 64999  # in the range no shipped server uses

# A request that fails on a field: (request code, body, words of the answer that name the field and
# what is wrong with it).
BadField = tuple[int, dict[str, Any], tuple[str, ...]]


@dataclass
class Case:
    """One kind of server and how to hold it to the promises."""

    metrics_prefix: str
    bad_type: BadField
    bad_range: BadField
    writes: tuple[int, Callable[[int], dict[str, Any]]]  # a request its storage must take, its n-th body
    cause: str  # words of the UNAVAILABLE answer that name the cause


@dataclass
class Running:
    case: Case
    port: int
    metrics_port: int
    break_storage: Callable[[], None]  # beyond the file-size limit, which the writes themselves reach


def _broker_send(i: int) -> dict[str, Any]:
    return {"messages": [{"id": f"big-{i}", "subject": "skeleton", "payload": BIG_PAYLOAD}]}


def _delay_send(i: int) -> dict[str, Any]:
    due = int(time.time() * 1000) + (i + 2) * HOUR_MS  # a bucket each: only the message log outgrows the limit
    return {"messages": [{"id": f"big-{i}", "subject": "skeleton", "payload": BIG_PAYLOAD, "deliver_at": due}]}


PULL = {"subject": "skeleton", "group": "g", "consumer": "c", "wait_ms": 0}
CASES = {
    "broker": Case(
        "qmq_broker",
        (RequestCode.BROKER_PULL, {**PULL, "wait_ms": "soon"}, ("'wait_ms'", "an integer", "str")),
        (RequestCode.BROKER_PULL, {**PULL, "max": MAX_PULL_MESSAGES + 1}, ("'max'", f"1-{MAX_PULL_MESSAGES}")),
        (RequestCode.BROKER_SEND, _broker_send),
        "File too large",
    ),
    "delay": Case(
        "qmq_delay",
        (RequestCode.DELAY_CANCEL, {"ids": "m1"}, ("'ids'", "a list")),
        (RequestCode.DELAY_CANCEL, {"ids": [f"m{i}" for i in range(5000)]}, ("'ids'", "5000", "4096")),
        (RequestCode.DELAY_SEND, _delay_send),
        "File too large",
    ),
    "meta": Case(
        "qmq_meta",
        (RequestCode.META_ROUTE, {"subject": "skeleton", "create": "yes"}, ("'create'", "a boolean")),
        (
            RequestCode.META_REGISTER,
            {"kind": "broker", "address": "127.0.0.1:1", "group": "g" * (MAX_GROUP_LEN + 1)},
            ("group", f"1-{MAX_GROUP_LEN}"),
        ),
        (RequestCode.META_ROUTE, lambda i: {"subject": f"s{i}", "create": True}),
        "database is unavailable",
    ),
}


def _start(processes, command: list[str], *, limit_files: bool) -> tuple[int, int]:
    """Start `qmq COMMAND` with metrics (under the file-size limit when asked); its port and metrics
    port once both listen."""
    port, metrics_port = free_port(), free_port()
    args = [sys.executable, "-m", "qmq", *command, "--port", str(port), "--metrics-port", str(metrics_port)]
    if limit_files:
        args = ["prlimit", f"--fsize={FILE_SIZE_LIMIT}", *args]
    proc = processes.start(
        args, name=command[0], env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": ""}, python=False
    )
    wait_for_port(port, proc)
    wait_for_port(metrics_port, proc)
    return port, metrics_port


@contextlib.contextmanager
def running(kind: str, processes, tmp_path: Path, pg_url: str) -> Iterator[Running]:
    if kind == "meta":
        with fresh_database(pg_url) as url:
            ports = _start(processes, ["meta", "--db", url], limit_files=False)
            yield Running(CASES[kind], *ports, lambda: set_connections_allowed(url, False))
        return
    data_dir = tmp_path / kind
    with LogStore(data_dir) as store:  # the first append makes the key index at full size: before the limit
        store.append_durable([Message("warm-up", "warm-up", b"")])
    command = ["broker", "--data-dir", str(data_dir)]
    if kind == "delay":
        command = ["delay-server", "--data-dir", str(data_dir), "--broker", f"{HOST}:{free_port()}"]
    yield Running(CASES[kind], *_start(processes, command, limit_files=True), lambda: None)


@pytest.mark.parametrize("kind", list(CASES))
def test_every_server_answers_bad_requests_and_storage_failures_alike_and_counts_them(
    kind: str, processes, tmp_path, pg_url
) -> None:
    with running(kind, processes, tmp_path, pg_url) as server:
        case = server.case
        with BlockingConnection.open(HOST, server.port, client_id="skeleton-test") as conn:
            with pytest.raises(RemoteError) as unknown:
                conn.request(UNKNOWN_CODE, {})
            assert unknown.value.code == ErrorCode.UNKNOWN_REQUEST
            assert str(UNKNOWN_CODE) in unknown.value.message
            for code, body, words in (case.bad_type, case.bad_range):
                with pytest.raises(RemoteError) as bad:
                    conn.request(code, body)
                assert bad.value.code == ErrorCode.BAD_REQUEST, bad.value
                assert all(w in bad.value.message for w in words), (words, bad.value.message)
            assert conn.request(RequestCode.PING, {"still": "here"}) == {"still": "here"}

            server.break_storage()
            code, body = case.writes
            failed = _until_unavailable(conn, code, body)
            assert failed.code == ErrorCode.UNAVAILABLE, failed
            assert case.cause in failed.message, failed.message
            assert conn.request(RequestCode.PING, {"still": "here"}) == {"still": "here"}

        text = scrape(server.metrics_port)
        prefix, writes = case.metrics_prefix, RequestCode(code).name.lower()
        assert sample(text, f"{prefix}_requests_total", request="ping") == 2
        assert sample(text, f"{prefix}_request_seconds_count", request="ping") == 2
        assert sample(text, f"{prefix}_request_errors_total", request="unknown", error="UNKNOWN_REQUEST") == 1
        for code, _, _ in (case.bad_type, case.bad_range):
            name = RequestCode(code).name.lower()
            assert sample(text, f"{prefix}_request_errors_total", request=name, error="BAD_REQUEST") >= 1
        assert sample(text, f"{prefix}_request_errors_total", request=writes, error="UNAVAILABLE") == 1
        assert sample(text, f"{prefix}_request_seconds_bucket", request=writes, le="+Inf") >= 1


def _until_unavailable(conn: BlockingConnection, code: int, body: Callable[[int], dict[str, Any]]) -> RemoteError:
    """Send `code` requests, growing the store, until one is refused; its error."""
    for i in range(16):
        try:
            conn.request(code, body(i))
        except RemoteError as exc:
            return exc
    raise AssertionError("no request was refused: the store took more than its file-size limit")
