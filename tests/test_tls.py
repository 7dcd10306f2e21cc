"""TLS on real server processes: a broker and a meta server with --tls-cert/--tls-key, clients with
a CA (blocking, asyncio, `qmq send`), mutual TLS with --tls-client-ca, a broker registering with a
TLS meta server through the client settings, and the clear errors when one side speaks TLS and the
other does not, or the certificate is not trusted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmq.client import Client, ClientError, OutgoingMessage, SendResult
from qmq.net.aio_client import AsyncConnection
from qmq.net.client import BlockingConnection
from qmq.net.tls import ClientTLS, configure_client
from qmq.protocol.codes import RequestCode
from tests.support.broker import start_broker
from tests.support.databases import fresh_database
from tests.support.processes import free_port, wait_for_port
from tests.support.tls import Certs, make_certs

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
DEADLINE_S = 20.0
OPENS = 200  # TLS connections opened one after the other (about a second)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("certs"))


def tls_broker(processes, tmp_path, certs: Certs, *args: str):
    return start_broker(
        processes, tmp_path / "broker", "--tls-cert", certs.server_cert, "--tls-key", certs.server_key, *args
    )


def test_tls_clients_blocking_and_asyncio(processes, tmp_path, certs):
    broker = tls_broker(processes, tmp_path, certs)
    tls = ClientTLS(certs.ca).context()
    with BlockingConnection.open(HOST, broker.port, tls=tls) as conn:
        assert conn.request(RequestCode.PING, {"x": b"y" * 300_000}) == {"x": b"y" * 300_000}
        stored = conn.request(
            RequestCode.BROKER_SEND, {"messages": [{"id": "m1", "subject": "tls.a", "payload": b"hello"}]}
        )
        assert stored["stored"] == 1

    async def asyncio_client() -> dict:
        conn = await AsyncConnection.open(HOST, broker.port, tls=tls)
        try:
            return await conn.request(RequestCode.PING, {"a": 1})
        finally:
            await conn.close()

    assert asyncio.run(asyncio_client()) == {"a": 1}


def test_many_tls_connections_each_open_at_once(processes, tmp_path, certs):
    """The blocking client's handshake over TLS never hangs: it used to, in about one open in 25,
    when its first write ran alongside the reader thread's first TLS read."""
    broker = tls_broker(processes, tmp_path, certs)
    tls = ClientTLS(certs.ca).context()
    for _ in range(OPENS):
        with BlockingConnection.open(HOST, broker.port, tls=tls, timeout=DEADLINE_S / 4) as conn:
            assert conn.request(RequestCode.PING, {"n": 1}, timeout=DEADLINE_S / 4) == {"n": 1}


def test_a_plain_client_is_refused_by_a_tls_server_with_a_clear_error(processes, tmp_path, certs):
    broker = tls_broker(processes, tmp_path, certs)
    with pytest.raises(ConnectionError) as info:
        BlockingConnection.open(HOST, broker.port, timeout=DEADLINE_S)
    assert "TLS" in str(info.value) and "--tls-ca" in str(info.value)


def test_a_tls_client_to_a_plain_server_gets_a_clear_error(processes, tmp_path, certs):
    broker = start_broker(processes, tmp_path / "plain")
    with pytest.raises(ConnectionError) as info:
        BlockingConnection.open(HOST, broker.port, tls=ClientTLS(certs.ca).context(), timeout=DEADLINE_S)
    assert "TLS" in str(info.value)


def test_a_server_certificate_from_another_ca_is_refused(processes, tmp_path, certs):
    broker = tls_broker(processes, tmp_path, certs)
    with pytest.raises(ConnectionError) as info:
        BlockingConnection.open(HOST, broker.port, tls=ClientTLS(certs.other_ca).context())
    assert "CERTIFICATE_VERIFY_FAILED" in str(info.value)


def test_mutual_tls_needs_a_client_certificate(processes, tmp_path, certs):
    broker = tls_broker(processes, tmp_path, certs, "--tls-client-ca", certs.ca)
    with BlockingConnection.open(
        HOST, broker.port, tls=ClientTLS(certs.ca, certs.client_cert, certs.client_key).context()
    ) as conn:
        assert conn.request(RequestCode.PING, {"m": 1}) == {"m": 1}
    # Without a certificate the TLS handshake itself fails (TLS 1.3 reports it on the first read).
    with pytest.raises(ConnectionError):
        BlockingConnection.open(HOST, broker.port, tls=ClientTLS(certs.ca).context(), timeout=DEADLINE_S)
    with BlockingConnection.open(
        HOST, broker.port, tls=ClientTLS(certs.ca, certs.client_cert, certs.client_key).context()
    ) as conn:  # and the server still serves the others
        assert conn.request(RequestCode.PING, {}) == {}


def test_servers_and_the_cli_speak_tls_to_each_other(processes, tmp_path, certs, pg_url):
    """A TLS meta server, a TLS broker that registers with it (its client settings from the
    environment), and `qmq send` / `qmq tail` with --tls-ca through the meta server."""
    tls_env = {"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_TLS_CA": certs.ca}
    server_tls = ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key]
    with fresh_database(pg_url) as db_url:
        meta_port = free_port()
        meta_proc = processes.start(
            ["-m", "qmq", "meta", "--port", str(meta_port), "--db", db_url, *server_tls], name="meta", env=tls_env
        )
        wait_for_port(meta_port, meta_proc)
        broker_port = free_port()
        meta = ["--meta", f"{HOST}:{meta_port}"]
        broker = processes.start(
            ["-m", "qmq", "broker", "--port", str(broker_port), "--data-dir", str(tmp_path / "b"), *server_tls, *meta],
            name="broker",
            env=tls_env,
        )
        wait_for_port(broker_port, broker)
        tls = ClientTLS(certs.ca).context()
        deadline = time.monotonic() + DEADLINE_S
        with BlockingConnection.open(HOST, meta_port, tls=tls) as conn:
            while not conn.request(RequestCode.META_LIST, {}).get("servers"):
                assert time.monotonic() < deadline, "the broker never registered over TLS"
                time.sleep(0.1)
        env = {**os.environ, "QMQ_TOKEN": "", "QMQ_TLS_CA": "", "PYTHONPATH": str(ROOT)}
        meta_arg = ["--meta", f"{HOST}:{meta_port}", "--tls-ca", certs.ca]
        sent = subprocess.run(
            [sys.executable, "-m", "qmq", "send", "tls.subject", "hello", *meta_arg],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert sent.returncode == 0, sent.stderr
        tail_args = ["--count", "1", "--timeout", "20", *meta_arg]
        tailed = subprocess.run(
            [sys.executable, "-m", "qmq", "tail", "tls.subject", "--group", "g", "--from", "earliest", *tail_args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert tailed.returncode == 0, tailed.stderr
        assert sent.stdout.strip() in tailed.stdout and "hello" in tailed.stdout
        refused = subprocess.run(
            [
                sys.executable,
                "-m",
                "qmq",
                "send",
                "tls.subject",
                "x",
                "--meta",
                f"{HOST}:{meta_port}",
                "--delivery-timeout",
                "0",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert refused.returncode != 0 and "TLS" in refused.stderr


def sent_once(**client_options) -> SendResult:
    """The result of one message sent by a client whose delivery timeout would wait ten minutes."""
    with Client(delivery_timeout_s=600, **client_options) as client:
        (result,) = client.send([OutgoingMessage("tls.refused", "hello")])
    return result


@pytest.fixture
def untrusting(certs) -> Iterator[None]:
    """This process's clients trust another CA than the one that signed the servers' certificates."""
    configure_client(ClientTLS(certs.other_ca))
    try:
        yield
    finally:
        configure_client(None)


@pytest.mark.timeout(120)
def test_a_send_through_a_refused_tls_handshake_fails_at_once_naming_it(processes, tmp_path, certs, untrusting):
    """A certificate the client does not trust is a setting to fix, not a moment to wait out: the send
    fails with the TLS error at once, though its delivery timeout would let it wait ten minutes for a
    broker that is merely down (the pytest timeout, 120 s, fails a send that waits)."""
    broker = tls_broker(processes, tmp_path, certs)
    result = sent_once(brokers=[f"{HOST}:{broker.port}"])
    assert not result.ok and "CERTIFICATE_VERIFY_FAILED" in (result.error or ""), result


@pytest.mark.timeout(120)
def test_a_send_through_a_meta_server_refusing_its_tls_fails_at_once_naming_it(processes, pg_url, certs, untrusting):
    """The same when the meta server is the one whose certificate the client does not trust."""
    with fresh_database(pg_url) as db_url:
        port = free_port()
        server_tls = ["--tls-cert", certs.server_cert, "--tls-key", certs.server_key]
        meta = processes.start(
            ["-m", "qmq", "meta", "--port", str(port), "--db", db_url, *server_tls],
            name="meta",
            env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": ""},
        )
        wait_for_port(port, meta)
        result = sent_once(meta=f"{HOST}:{port}")
    assert not result.ok and "CERTIFICATE_VERIFY_FAILED" in (result.error or ""), result


@pytest.mark.timeout(120)
def test_a_subscription_to_a_broker_refusing_its_tls_fails_naming_it(processes, tmp_path, certs, untrusting):
    """A subscription whose broker's certificate the client does not trust raises the TLS error, as
    for a wrong token, instead of pulling again for ever with a warning."""
    broker = tls_broker(processes, tmp_path, certs)
    with Client(brokers=[f"{HOST}:{broker.port}"]) as client, pytest.raises(ClientError) as refused:
        client.subscribe("tls.refused", "g")
    assert "CERTIFICATE_VERIFY_FAILED" in str(refused.value)
