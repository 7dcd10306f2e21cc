"""`qmq dev`: one command brings up a meta server, a broker group, the delay server and a relay that a
producer and a consumer can use at once, with the web console printed in its banner and metrics when
asked; a server that dies is reported and
started again while the others keep running, and the relay ships what the app committed meanwhile
into its own PostgreSQL database; Ctrl-C takes every one of them down."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import pytest

import qmq
from qmq.client.blocking import Client
from qmq.db.engine import create_engine
from qmq.net.client import BlockingConnection
from qmq.net.tls import ClientTLS
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT
from tests.support.databases import fresh_database
from tests.support.outbox import consume, outbox_rows
from tests.test_meta import log_text, wait_until

FREE_PORTS = ("--meta-port", "0", "--broker-port", "0", "--delay-port", "0", "--console-port", "0")
DEV_ENV = {"PYTHONPATH": str(ROOT), "QMQ_DB_URL": "", "QMQ_META": ""}


def start_dev(processes, tmp_path, *flags: str):
    """`qmq dev` on free ports; returns the process and what it printed once it is up."""
    dev = processes.start(
        ["-m", "qmq", "dev", "--data-dir", str(tmp_path / "dev"), *FREE_PORTS, *flags],
        name="dev",
        env=DEV_ENV,
    )
    text = wait_until(
        lambda: "Ctrl-C stops everything" in log_text(dev) and log_text(dev), "the cluster is up", deadline_s=60
    )
    return dev, text


def children(dev) -> dict[str, int]:
    """The cluster's servers by name ("meta", "broker", "delay-server", "relay"): their pids."""
    listing = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(dev.pid)], capture_output=True, text=True)
    found = {}
    for line in listing.stdout.splitlines():
        pid, args = line.split(None, 1)
        found[args.split(" -m qmq ", 1)[1].split()[0]] = int(pid)
    return found


def scrape(port: int) -> bytes:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            return reply.read()
    except OSError:
        return b""


def alive(pid: int) -> bool:
    return subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode == 0


def qmq_cli(*args: str, meta: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args, "--meta", meta],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **DEV_ENV, **(env or {})},
    )


def test_the_dev_cluster_serves_and_stops_on_ctrl_c(processes, tmp_path) -> None:
    dev, text = start_dev(processes, tmp_path, "--metrics-port", "0")
    meta = re.search(r"QMQ_META=(\S+)", text).group(1)
    outbox_url = re.search(r"QMQ_DB_URL=(\S+)", text).group(1)
    servers = children(dev)
    assert set(servers) == {"meta", "broker", "delay-server", "console", "relay"}
    console = re.search(r"web console +(\S+)", text).group(1)
    with urllib.request.urlopen(console + "/", timeout=30) as page:  # the banner's console shows this cluster
        assert meta in page.read().decode()
    metrics = dict(re.findall(r"(meta|broker|delay-server|relay) (\d+)", text.split("metrics", 1)[1]))
    for port in metrics.values():  # the relay has no port of its own to wait for: its metrics may come later
        wait_until(lambda port=port: b"# TYPE" in scrape(port), f"metrics on port {port}")

    engine = create_engine(outbox_url)
    producer = qmq.Producer(meta=meta, engine=engine, after_commit=False)  # left to the cluster's relay
    relayed = producer.send_now("dev.check", {"via": "relay"})
    producer.close()
    with Client(meta=meta) as client:
        direct = client.send_one("dev.check", {"via": "client"}).message_id
        sub = client.subscribe("dev.check", "dev-test", start="earliest")
        got = []
        wait_until(lambda: got.extend(sub.pull(10, 0.5)) or len(got) >= 2, "both messages arrive")
        assert sorted(d.id for d in got) == sorted([relayed, direct])
        sub.close()
    engine.dispose()

    # The quick start's line: a JSON string body arrives as application/json.
    sent = qmq_cli("send", "hello", '"world"', "--json", meta=meta)
    assert sent.returncode == 0, sent.stderr
    tail = qmq_cli("tail", "hello", "--group", "me", "--from", "earliest", "--count", "1", meta=meta)
    assert tail.returncode == 0, tail.stderr
    message = json.loads(tail.stdout.splitlines()[0])
    assert (message["id"], message["body"], message["content_type"]) == (
        sent.stdout.strip(),
        "world",
        "application/json",
    )

    os.killpg(dev.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    assert dev.wait(30) == 0
    for pid in servers.values():
        assert not alive(pid), f"{pid} still runs"


def test_a_broker_killed_under_qmq_dev_comes_back_and_the_relay_ships_what_was_committed_meanwhile(
    processes, tmp_path, pg_url
) -> None:
    with fresh_database(pg_url) as app_db:
        dev, text = start_dev(processes, tmp_path, "--db", app_db, "--restart-after", "8")
        meta = re.search(r"QMQ_META=(\S+)", text).group(1)
        broker = re.search(r"broker group +\S+ +(\S+)", text).group(1)
        servers = children(dev)
        engine = create_engine(app_db)  # the app's own database, which `qmq dev --db` watches
        producer = qmq.Producer(meta=meta, engine=engine)

        @qmq.transactional(producer)
        def place_order(session, order_id: int) -> str:
            return producer.send("order.created", {"id": order_id})

        os.kill(servers["broker"], signal.SIGKILL)
        wait_until(lambda: "the broker exited with -9" in log_text(dev), "qmq dev reports the dead broker")
        committed = place_order(order_id=1)  # during the outage
        assert producer.flush(10)
        row = outbox_rows(engine)[committed]
        assert row.state == "pending" and row.attempts >= 1  # the after-commit sender could not ship it
        assert all(alive(servers[name]) for name in ("meta", "delay-server", "relay"))  # the others keep running

        wait_until(lambda: "the broker is running again" in log_text(dev), "qmq dev starts the broker again")
        [delivery] = consume(broker, "order.created", 1)
        assert (delivery.id, delivery.body) == (committed, {"id": 1})
        wait_until(lambda: outbox_rows(engine)[committed].state == "sent", "the relay marked it sent")
        producer.close()
        engine.dispose()
        os.killpg(dev.pid, signal.SIGINT)
        assert dev.wait(30) == 0


def test_the_dev_cluster_with_tls_serves_over_tls_only(processes, tmp_path) -> None:
    dev, text = start_dev(processes, tmp_path, "--tls", "--no-console")
    meta = re.search(r"QMQ_META=(\S+)", text).group(1)
    broker = re.search(r"broker group +\S+ +(\S+)", text).group(1)
    ca = re.search(r"QMQ_TLS_CA=(\S+)", text).group(1)
    delay = re.search(r"delay server +(\S+)", text).group(1)
    tls_env = {"QMQ_TLS_CA": ca}

    # A send (one through the delay server, which forwards it to the broker over TLS) and a consume.
    sent = qmq_cli("send", "dev.tls", '"now"', "--json", meta=meta, env=tls_env)
    assert sent.returncode == 0, sent.stderr
    delayed = qmq_cli("send", "dev.tls", '"later"', "--json", "--delay", "1", meta=meta, env=tls_env)
    assert delayed.returncode == 0, delayed.stderr
    tail = qmq_cli("tail", "dev.tls", "--group", "me", "--from", "earliest", "--count", "2", meta=meta, env=tls_env)
    assert tail.returncode == 0, tail.stderr
    got = {json.loads(line)["id"]: json.loads(line)["body"] for line in tail.stdout.splitlines()}
    assert got == {sent.stdout.strip(): "now", delayed.stdout.strip(): "later"}

    for address in (meta, broker, delay):  # TLS with the session's CA: served; plain TCP: refused
        host, port = address.rsplit(":", 1)
        with BlockingConnection.open(host, int(port), token="", tls=ClientTLS(ca).context()) as conn:
            assert conn.request(RequestCode.PING, {"n": 1}) == {"n": 1}
        with pytest.raises(OSError):  # ConnectionError or TimeoutError: the server never answers in plain
            BlockingConnection.open(host, int(port), token="", timeout=5)
    plain = qmq_cli("send", "dev.tls", '"plain"', "--json", "--delivery-timeout", "0", meta=meta)
    assert plain.returncode != 0
    os.killpg(dev.pid, signal.SIGINT)
    assert dev.wait(30) == 0
