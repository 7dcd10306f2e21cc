"""Per-application credentials on real processes: a meta server on PostgreSQL and a broker that
registers with it, both with a shared token; `qmq admin credentials create|list|revoke`; a
credential allowed for the subjects and groups of its ACL, FORBIDDEN for others and for
administration, on the broker and the meta server; a wrong secret refused at the handshake; a revoked
credential refused on new and open connections; the shared token still doing everything."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.databases import fresh_database
from tests.support.processes import free_port, wait_for_port

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TOKEN = "shared-test-token"
DEADLINE_S = 30.0  # a revocation reaches the broker within its check cache (10 s)
COMMAND_TIMEOUT_S = 60


@pytest.fixture
def cluster(processes, pg_url, tmp_path):
    with fresh_database(pg_url) as db_url:
        env = {"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": ""}
        meta_port, broker_port = free_port(), free_port()
        meta = processes.start(
            ["-m", "qmq", "meta", "--port", str(meta_port), "--db", db_url, "--token", TOKEN], name="meta", env=env
        )
        wait_for_port(meta_port, meta)
        broker_args = ["--port", str(broker_port), "--data-dir", str(tmp_path / "b"), "--token", TOKEN]
        broker = processes.start(
            ["-m", "qmq", "broker", *broker_args, "--meta", f"{HOST}:{meta_port}"], name="broker", env=env
        )
        wait_for_port(broker_port, broker)
        deadline = time.monotonic() + DEADLINE_S
        with BlockingConnection.open(HOST, meta_port, token=TOKEN) as conn:
            while not conn.request(RequestCode.META_LIST, {}).get("servers"):
                assert time.monotonic() < deadline, "the broker never registered"
                time.sleep(0.1)
        yield meta_port, broker_port


def qmq(*args: str, token: str = TOKEN) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QMQ_TOKEN": token, "QMQ_META": "", "QMQ_TLS_CA": ""}
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], env=env, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
    )


def create(meta_port: int, *args: str) -> dict:
    made = qmq("admin", "credentials", "create", "--meta", f"{HOST}:{meta_port}", "--json", *args)
    assert made.returncode == 0, made.stderr
    return json.loads(made.stdout)


def send(conn: BlockingConnection, subject: str) -> dict:
    message = {"id": f"m-{time.monotonic_ns()}", "subject": subject, "payload": b"x"}
    return conn.request(RequestCode.BROKER_SEND, {"messages": [message]})


def forbidden(conn: BlockingConnection, code: int, body: dict) -> str:
    with pytest.raises(RemoteError) as info:
        conn.request(code, body)
    assert info.value.code == ErrorCode.FORBIDDEN
    assert conn.request(RequestCode.PING, {"open": 1}) == {"open": 1}  # the connection stays usable
    return info.value.message


def pull(subject: str, group: str) -> dict:
    return {"subject": subject, "group": group, "consumer": "c1", "max": 8, "wait_ms": 0, "start": "earliest"}


def test_a_credential_may_touch_its_subjects_only(cluster):
    meta_port, broker_port = cluster
    made = create(meta_port, "--app", "billing", "--produce", "order.*", "--consume", "order.created:billing")
    token = made["token"]
    assert made["app"] == "billing" and token.startswith("qmqc.")
    with BlockingConnection.open(HOST, broker_port, token=token) as conn:
        assert send(conn, "order.created")["stored"] == 1
        message = forbidden(conn, RequestCode.BROKER_SEND, {"messages": [{"id": "p1", "subject": "payment.done"}]})
        assert "billing" in message and "payment.done" in message
        assert conn.request(RequestCode.BROKER_PULL, pull("order.created", "billing"))["batches"]
        assert "audit" in forbidden(conn, RequestCode.BROKER_PULL, pull("order.created", "audit"))
        forbidden(conn, RequestCode.BROKER_PULL, pull("order.shipped", "billing"))
        forbidden(conn, RequestCode.BROKER_STATS, {})
        forbidden(conn, RequestCode.BROKER_RESET, {"subject": "order.created", "group": "billing", "to": "latest"})
    with BlockingConnection.open(HOST, meta_port, token=token) as conn:
        assert conn.request(RequestCode.META_ROUTE, {"subject": "order.created", "create": True})["groups"]
        forbidden(conn, RequestCode.META_LIST, {})
        forbidden(conn, RequestCode.META_CREDENTIAL_CREATE, {"app": "x", "admin": True})
    # Through the client library: `qmq send` with the credential as its token.
    sent = qmq("send", "order.created", "hello", "--meta", f"{HOST}:{meta_port}", token=token)
    assert sent.returncode == 0, sent.stderr
    refused = qmq("send", "payment.done", "hello", "--meta", f"{HOST}:{meta_port}", token=token)
    assert refused.returncode != 0 and "FORBIDDEN" in refused.stderr
    # The shared token still does everything.
    with BlockingConnection.open(HOST, broker_port, token=TOKEN) as conn:
        assert send(conn, "payment.done")["stored"] == 1
        assert conn.request(RequestCode.BROKER_STATS, {})


def test_a_wrong_secret_and_a_revoked_credential_are_refused(cluster):
    meta_port, broker_port = cluster
    made = create(meta_port, "--app", "audit", "--consume", "*:audit")
    token = made["token"]
    with pytest.raises(RemoteError) as info:
        BlockingConnection.open(HOST, broker_port, token=token[:-4] + "AAAA")
    assert info.value.code == ErrorCode.UNAUTHORIZED and token[-10:] not in info.value.message
    open_conn = BlockingConnection.open(HOST, broker_port, token=token)
    assert open_conn.request(RequestCode.BROKER_PULL, pull("order.created", "audit")) is not None
    listed = qmq("admin", "credentials", "list", "--meta", f"{HOST}:{meta_port}", "--json")
    assert listed.returncode == 0 and made["id"] in listed.stdout and token not in listed.stdout
    revoked = qmq("admin", "credentials", "revoke", made["id"], "--meta", f"{HOST}:{meta_port}")
    assert revoked.returncode == 0, revoked.stderr
    with pytest.raises(RemoteError) as info:  # the meta server itself refuses it at once
        BlockingConnection.open(HOST, meta_port, token=token)
    assert info.value.code == ErrorCode.UNAUTHORIZED
    deadline = time.monotonic() + DEADLINE_S
    while True:  # the broker within its check cache, on new connections ...
        try:
            BlockingConnection.open(HOST, broker_port, token=token).close()
        except RemoteError as exc:
            assert exc.code == ErrorCode.UNAUTHORIZED
            break
        assert time.monotonic() < deadline, "the broker still takes a revoked credential"
        time.sleep(0.2)
    while True:  # ... and on the connection that was open
        try:
            open_conn.request(RequestCode.BROKER_PULL, pull("order.created", "audit"))
        except (ConnectionError, RemoteError) as exc:
            assert "UNAUTHORIZED" in str(exc)
            break
        assert time.monotonic() < deadline, "an open connection kept a revoked credential"
        time.sleep(0.2)
    open_conn.close()
    # Revoking twice says so.
    again = qmq("admin", "credentials", "revoke", made["id"], "--meta", f"{HOST}:{meta_port}")
    assert again.returncode == 1 and "was not active" in again.stdout
