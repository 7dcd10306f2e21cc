"""`qmq meta` as a real process on SQLite and PostgreSQL, driven over real sockets: registration,
routes, read-only flags, heartbeat timeouts, restarts after SIGKILL, the token, bad input, a database
that goes away and comes back, metrics and SIGTERM."""

from __future__ import annotations

import signal
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from qmq.client import Client, OutgoingMessage
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support import waiting
from tests.support.databases import fresh_database, set_connections_allowed, sqlite_or_postgres
from tests.support.processes import ProcessManager, free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
SHORT_TIMEOUT_S = 1.0  # --heartbeat-timeout for the liveness tests
STATE_DEADLINE_S = 15.0  # how long a state flip (timeout expiry, log line) may take to show
EXIT_TIMEOUT_S = 15.0


def start_meta(processes, db_url: str, *args: str, port: int | None = None, name: str = "meta"):
    port = port or free_port()
    proc = processes.start(
        ["-m", "qmq", "meta", "--port", str(port), "--db", db_url, *args],
        name=name,
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": ""},
    )
    wait_for_port(port, proc)
    return proc, port


def connect(port: int, token: str | None = "") -> BlockingConnection:
    return BlockingConnection.open(HOST, port, client_id="meta-test", token=token)


def register(
    conn: BlockingConnection,
    address: str,
    group: str | None = None,
    *,
    kind: str = "broker",
    code: int = RequestCode.META_HEARTBEAT,
) -> dict[str, Any]:
    body: dict[str, Any] = {"kind": kind, "address": address}
    if group is not None:
        body["group"] = group
    return conn.request(code, body)


def route(conn: BlockingConnection, subject: str, create: bool) -> dict[str, Any]:
    return conn.request(RequestCode.META_ROUTE, {"subject": subject, "create": create})


def group_names(reply: dict[str, Any]) -> list[str]:
    return [g["name"] for g in reply["groups"]]


def wait_until(condition: Callable[[], Any], what: str, deadline_s: float = STATE_DEADLINE_S) -> Any:
    """Poll `condition` until it returns something truthy. Used only where the server's state changes
    with the passing of time (a heartbeat timeout) or in another process's log file."""
    return waiting.wait_until(condition, what, deadline_s)


def log_text(proc) -> str:
    return proc.log_path.read_text(errors="replace")


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'meta.sqlite3'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def any_db_url(request, tmp_path):
    with sqlite_or_postgres(request.param, request, tmp_path, "meta.sqlite3") as url:
        yield url


# -- registration and routes --------------------------------------------------------------------------


def test_routes_least_loaded_first_read_only_and_delay_servers(processes, sqlite_url) -> None:
    proc, port = start_meta(processes, sqlite_url)
    with connect(port) as conn:
        reply = register(conn, "127.0.0.1:30001", "g1", code=RequestCode.META_REGISTER)
        assert reply == {"heartbeat_interval_s": 10, "read_only": False}
        register(conn, "127.0.0.1:30002", "g2")
        register(conn, "127.0.0.1:20890", kind="delay")

        first = route(conn, "order.created", create=True)
        assert first["subject"] == "order.created"
        assert first["groups"] == [
            {"name": "g1", "addresses": ["127.0.0.1:30001"], "available": True, "read_only": False},
            {"name": "g2", "addresses": ["127.0.0.1:30002"], "available": True, "read_only": False},
        ]
        assert first["delay_servers"] == [{"address": "127.0.0.1:20890", "available": True}]

        register(conn, "127.0.0.1:30003", "g3")  # carries nothing yet: first for the next subject
        assert group_names(route(conn, "order.paid", create=True)) == ["g3", "g1"]
        assert group_names(route(conn, "order.created", create=True)) == ["g1", "g2"]  # stable
        assert route(conn, "never.produced", create=False)["groups"] == []

        assert conn.request(RequestCode.META_SET_READ_ONLY, {"group": "g2", "read_only": True}) == {
            "group": "g2",
            "read_only": True,
            "changed": True,
        }
        assert register(conn, "127.0.0.1:30002", "g2")["read_only"] is True  # brokers learn it by heartbeat
        assert group_names(route(conn, "order.shipped", create=True)) == ["g3", "g1"]  # g2 is skipped
        flags = {g["name"]: g["read_only"] for g in route(conn, "order.created", create=False)["groups"]}
        assert flags == {"g1": False, "g2": True}

        # order.created has one writable group left (g1): a producer's request tops it up with g3.
        assert group_names(route(conn, "order.created", create=True)) == ["g1", "g2", "g3"]

        listing = conn.request(RequestCode.META_LIST)
        assert {g["name"]: g["subjects"] for g in listing["groups"]} == {"g1": 3, "g2": 1, "g3": 3}
        assert {s["address"]: s["kind"] for s in listing["servers"]} == {
            "127.0.0.1:20890": "delay",
            "127.0.0.1:30001": "broker",
            "127.0.0.1:30002": "broker",
            "127.0.0.1:30003": "broker",
        }
        assert {r["subject"] for r in listing["routes"]} == {"order.created", "order.paid", "order.shipped"}

    text = wait_until(lambda: (t := log_text(proc)) and "route order.created extended" in t and t, "log lines")
    assert "broker 127.0.0.1:30001 in group g1 registered" in text
    assert "group g2 is now read-only" in text
    assert "route order.created created: groups g1, g2" in text


def test_heartbeat_timeout_then_back(processes, sqlite_url) -> None:
    proc, port = start_meta(processes, sqlite_url, "--heartbeat-timeout", str(SHORT_TIMEOUT_S))
    with connect(port) as conn:
        for i, group in enumerate(["g1", "g2", "g3"]):
            register(conn, f"127.0.0.1:{30001 + i}", group)
        assert group_names(route(conn, "s", create=True)) == ["g1", "g2"]

        def g2_down() -> bool:
            register(conn, "127.0.0.1:30001", "g1")  # g1 and g3 keep heartbeating, g2 went quiet
            register(conn, "127.0.0.1:30003", "g3")
            groups = {g["name"]: g["available"] for g in route(conn, "s", create=False)["groups"]}
            return groups == {"g1": True, "g2": False}

        wait_until(g2_down, "g2 unavailable after its heartbeat timeout")
        wait_until(
            lambda: g2_down() and "broker 127.0.0.1:30002 in group g2 became unavailable" in log_text(proc),
            "the server to log that g2's broker became unavailable",
        )
        # A producer keeps two writable groups: g3 replaces g2, and consumers still see g2 to drain it.
        producer = route(conn, "s", create=True)
        assert [(g["name"], g["available"]) for g in producer["groups"]] == [("g1", True), ("g2", False), ("g3", True)]
        assert producer["groups"][1]["addresses"] == ["127.0.0.1:30002"]

        register(conn, "127.0.0.1:30002", "g2")  # back at once with its next heartbeat
        assert all(g["available"] for g in route(conn, "s", create=False)["groups"])

        assert conn.request(RequestCode.META_UNREGISTER, {"address": "127.0.0.1:30002"}) == {"unregistered": True}
        assert not {g["name"]: g["available"] for g in route(conn, "s", create=False)["groups"]}["g2"]
        assert conn.request(RequestCode.META_UNREGISTER, {"address": "127.0.0.1:1"}) == {"unregistered": False}

    text = wait_until(lambda: (t := log_text(proc)) and "unregistered" in t and t, "log line")
    assert "group g2 became unavailable" in text
    assert "broker 127.0.0.1:30002 in group g2 available again" in text


def test_routes_and_groups_survive_sigkill(processes, any_db_url) -> None:
    proc, port = start_meta(processes, any_db_url, name="meta-first")
    with connect(port) as conn:
        for i, group in enumerate(["g1", "g2", "g3"]):
            register(conn, f"127.0.0.1:{30001 + i}", group)
        conn.request(RequestCode.META_SET_READ_ONLY, {"group": "g3", "read_only": True})
        before = route(conn, "order.created", create=True)
        assert group_names(before) == ["g1", "g2"]
    assert processes.kill(proc) == -signal.SIGKILL

    proc, port = start_meta(processes, any_db_url, name="meta-second")
    with connect(port) as conn:
        after = route(conn, "order.created", create=False)
        assert after == before
        listing = conn.request(RequestCode.META_LIST)
        assert {g["name"]: g["read_only"] for g in listing["groups"]} == {"g1": False, "g2": False, "g3": True}


def test_concurrent_registrations_and_routes(processes, any_db_url) -> None:
    """Many requests in flight at once (one pipelined connection, many threads): every one succeeds,
    each group is created once, and every subject gets exactly two groups."""
    _, port = start_meta(processes, any_db_url)
    subjects = [f"s{i}" for i in range(30)]
    with connect(port) as conn, ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda i: register(conn, f"127.0.0.1:{31000 + i}", f"g{i % 4}"), range(12)))
        routes = list(pool.map(lambda s: route(conn, s, create=True), subjects))
        assert all(len(r["groups"]) == 2 for r in routes)
        listing = conn.request(RequestCode.META_LIST)
    assert sorted(g["name"] for g in listing["groups"]) == ["g0", "g1", "g2", "g3"]
    assert sum(g["subjects"] for g in listing["groups"]) == 2 * len(subjects)
    assert max(g["subjects"] for g in listing["groups"]) - min(g["subjects"] for g in listing["groups"]) <= 2


# -- access, bad input, outages, process life -----------------------------------------------------------


def test_token_is_required_when_set(processes, sqlite_url) -> None:
    _, port = start_meta(processes, sqlite_url, "--token", "s3cret")
    with pytest.raises(RemoteError) as refused:
        connect(port, token=None)
    assert refused.value.code == ErrorCode.UNAUTHORIZED
    with pytest.raises(RemoteError) as wrong:
        connect(port, token="wrong")
    assert wrong.value.code == ErrorCode.UNAUTHORIZED
    with connect(port, token="s3cret") as conn:
        assert route(conn, "a", create=False)["groups"] == []
    # A client with the wrong token is told at once: a refusal is not waited out like an outage.
    with Client(meta=f"127.0.0.1:{port}", token="wrong", delivery_timeout_s=120) as client:
        started = time.monotonic()
        [result] = client.send([OutgoingMessage("a", "x")])
    assert not result.ok and result.error_code == ErrorCode.UNAUTHORIZED, result
    assert result.error.startswith("the meta server at") and "within" not in result.error, result.error
    assert time.monotonic() - started < 60  # not its delivery timeout


@pytest.mark.parametrize(
    ("code", "body", "error", "message"),
    [
        (RequestCode.META_ROUTE, {"create": True}, ErrorCode.BAD_REQUEST, "missing field 'subject'"),
        (RequestCode.META_ROUTE, {"subject": "bad subject!"}, ErrorCode.BAD_SUBJECT, "may only contain"),
        (RequestCode.META_ROUTE, {"subject": "a", "create": "yes"}, ErrorCode.BAD_REQUEST, "must be a boolean"),
        (RequestCode.META_REGISTER, {"kind": "broker", "address": "h:1"}, ErrorCode.BAD_REQUEST, "'group'"),
        (RequestCode.META_REGISTER, {"kind": "x", "address": "h:1", "group": "g"}, ErrorCode.BAD_REQUEST, "kind"),
        (RequestCode.META_HEARTBEAT, {"kind": "delay", "address": "nohost"}, ErrorCode.BAD_REQUEST, "host:port"),
        (RequestCode.META_HEARTBEAT, {"address": "h:1"}, ErrorCode.BAD_REQUEST, "missing field 'kind'"),
        (RequestCode.META_SET_READ_ONLY, {"group": "ghost", "read_only": True}, ErrorCode.BAD_REQUEST, "'ghost'"),
        (RequestCode.META_SET_READ_ONLY, {"group": "ghost"}, ErrorCode.BAD_REQUEST, "'read_only'"),
        (RequestCode.META_UNREGISTER, {}, ErrorCode.BAD_REQUEST, "'address'"),
        (64999, {}, ErrorCode.UNKNOWN_REQUEST, "64999"),
    ],
)
def test_bad_requests_get_an_error_frame_and_the_connection_lives_on(meta_port, code, body, error, message) -> None:
    with connect(meta_port) as conn:
        with pytest.raises(RemoteError) as failed:
            conn.request(code, body)
        assert failed.value.code == error
        assert message in failed.value.message
        assert conn.request(RequestCode.PING, {"still": "here"}) == {"still": "here"}
        assert route(conn, "fine", create=False)["subject"] == "fine"


@pytest.fixture(scope="module")
def meta_port(tmp_path_factory):
    """One meta server shared by the bad-input cases (they change nothing)."""
    manager = ProcessManager(tmp_path_factory.mktemp("meta-bad-input"))
    try:
        _, port = start_meta(manager, f"sqlite:///{tmp_path_factory.mktemp('db') / 'meta.sqlite3'}")
        yield port
    finally:
        manager.stop_all()


def test_database_outage_gives_unavailable_then_recovers(processes, pg_url) -> None:
    with fresh_database(pg_url) as url:
        proc, port = start_meta(processes, url)
        with connect(port) as conn:
            register(conn, "127.0.0.1:30001", "g1")
            set_connections_allowed(url, False)
            try:
                with pytest.raises(RemoteError) as down:
                    route(conn, "a", create=True)
                assert down.value.code == ErrorCode.UNAVAILABLE
                assert "database is unavailable" in down.value.message
                with pytest.raises(RemoteError):  # still down, still answered
                    register(conn, "127.0.0.1:30001", "g1")
            finally:
                set_connections_allowed(url, True)
            assert group_names(route(conn, "a", create=True)) == ["g1"]  # same connection, DB back
            register(conn, "127.0.0.1:30001", "g1")
        assert proc.poll() is None
        text = wait_until(lambda: (t := log_text(proc)) and "database reachable again" in t and t, "log line")
        assert "database unavailable" in text
        processes.kill(proc, signal.SIGTERM)


def test_metrics_and_sigterm_exit_zero(processes, sqlite_url) -> None:
    metrics_port = free_port()
    proc, port = start_meta(processes, sqlite_url, "--metrics-port", str(metrics_port))
    wait_for_port(metrics_port, proc)
    conn = connect(port)
    register(conn, "127.0.0.1:30001", "g1")
    route(conn, "a", create=True)

    def scraped() -> str | None:
        with urllib.request.urlopen(f"http://{HOST}:{metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        published = 'qmq_meta_servers{kind="broker",state="available"} 1.0' in text
        return text if published and "qmq_meta_route_groups 1.0" in text else None

    # The gauges are published by the periodic sweep: one that began before the route was made
    # shows the server but not yet the route, so wait for a sweep that saw both.
    text = wait_until(scraped, "a sweep to publish the server and the route")
    assert 'qmq_meta_requests_total{request="meta_route"} 1.0' in text

    assert processes.kill(proc, signal.SIGTERM) == 0  # with a client still connected
    with pytest.raises(ConnectionError):
        conn.request(RequestCode.PING, {})
    conn.close()
    assert "meta server stopped" in log_text(proc)


def test_default_database_is_a_file_in_the_working_directory(processes, tmp_path) -> None:
    port = free_port()
    proc = processes.start(
        ["sh", "-c", f'cd "{tmp_path}" && exec "{sys.executable}" -m qmq meta --port {port}'],
        name="meta-default",
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_DB_URL": ""},
        python=False,
    )
    wait_for_port(port, proc)
    with connect(port) as conn:
        register(conn, "127.0.0.1:30001", "g1")
    assert (tmp_path / "qmq-meta.sqlite3").is_file()
    assert processes.kill(proc, signal.SIGTERM) == 0
