"""The meta server's internal and external listeners (qmq.meta.listeners, docs/meta.md): a broker that
advertises an address only its own network resolves (`broker-x.invalid`) and a second one for the
outside is reachable through the external listener, by `qmq send` and `qmq tail` as a user types them;
the internal listener still hands out the internal address; bad input is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from qmq.meta.listeners import external_view, internal_view
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.broker import ROOT, start_broker
from tests.support.processes import free_port, wait_for_port
from tests.support.replication import wait_role
from tests.test_meta import wait_until

HOST = "127.0.0.1"
INSIDE_ONLY = "broker-x.invalid"  # a name no resolver answers (RFC 6761): only "inside" knows it
CLI_TIMEOUT_S = 60


def test_views_swap_addresses_for_the_outside_and_drop_the_extra_fields() -> None:
    reply = {
        "subject": "s",
        "groups": [{"name": "g", "addresses": ["b:1"], "external_addresses": ["127.0.0.1:9"], "available": True}],
        "delay_servers": [{"address": "d:2", "external_address": "127.0.0.1:8", "available": True}],
    }
    assert internal_view(RequestCode.META_ROUTE, reply) == {
        "subject": "s",
        "groups": [{"name": "g", "addresses": ["b:1"], "available": True}],
        "delay_servers": [{"address": "d:2", "available": True}],
    }
    assert external_view(RequestCode.META_ROUTE, reply) == {
        "subject": "s",
        "groups": [{"name": "g", "addresses": ["127.0.0.1:9"], "available": True}],
        "delay_servers": [{"address": "127.0.0.1:8", "available": True}],
    }
    listing = {"servers": [{"address": "b:1", "external_address": "b:1", "kind": "broker"}], "groups": []}
    assert external_view(RequestCode.META_LIST, listing)["servers"] == [{"address": "b:1", "kind": "broker"}]
    assert external_view(RequestCode.META_HEARTBEAT, {"read_only": False}) == {"read_only": False}
    listing = {
        "servers": [
            {"address": "a:1", "external_address": "127.0.0.1:1", "kind": "broker"},
            {"address": "a2:1", "external_address": "127.0.0.1:2", "kind": "broker"},
        ],
        "replication": [
            {"group": "a", "epoch": 1, "master": "a:1", "in_sync": ["a2:1"], "members": [{"address": "a2:1"}]}
        ],
    }
    assert external_view(RequestCode.META_LIST, listing)["replication"] == [
        {
            "group": "a",
            "epoch": 1,
            "master": "127.0.0.1:1",
            "in_sync": ["127.0.0.1:2"],
            "members": [{"address": "127.0.0.1:2"}],
        }
    ]
    assert internal_view(RequestCode.META_LIST, listing)["replication"] == listing["replication"]


@pytest.fixture
def cluster(processes, tmp_path):
    """A meta server with both listeners and a broker known inside as broker-x.invalid."""
    port, external = free_port(), free_port()
    meta = processes.start(
        [
            "-m",
            "qmq",
            "meta",
            "--port",
            str(port),
            "--external-port",
            str(external),
            "--db",
            f"sqlite:///{tmp_path}/m.db",
        ],
        name="meta",
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": ""},
    )
    wait_for_port(port, meta)
    wait_for_port(external, meta)
    broker_port = free_port()
    broker = start_broker(
        processes,
        tmp_path / "broker",
        "--meta",
        f"{HOST}:{port}",
        "--group",
        "x",
        "--advertise",
        f"{INSIDE_ONLY}:{broker_port}",
        "--advertise-external",
        f"{HOST}:{broker_port}",
        port=broker_port,
    )
    wait_role(broker, "master")  # a send to a broker still pending is refused
    conn = BlockingConnection.open(HOST, port, client_id="listener-test", token="")
    try:
        yield port, external, broker_port, conn
    finally:
        conn.close()


def route_addresses(port: int, subject: str) -> list[str]:
    with BlockingConnection.open(HOST, port, client_id="listener-test", token="") as conn:
        reply = conn.request(RequestCode.META_ROUTE, {"subject": subject, "create": True})
    return [a for g in reply["groups"] for a in g["addresses"]]


def qmq(*args: str, meta: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QMQ_META": meta, "QMQ_TOKEN": ""}
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], capture_output=True, text=True, env=env, timeout=CLI_TIMEOUT_S
    )


def test_the_external_listener_hands_out_external_addresses_and_the_cli_works_through_it(cluster) -> None:
    port, external, broker_port, _ = cluster
    wait_until(lambda: route_addresses(port, "order.created"), "the broker registered")
    assert route_addresses(port, "order.created") == [f"{INSIDE_ONLY}:{broker_port}"]
    assert route_addresses(external, "order.created") == [f"{HOST}:{broker_port}"]

    # The README's commands from outside: through the external listener, with no /etc/hosts entry.
    sent = qmq("send", "order.created", '{"id": 7}', meta=f"{HOST}:{external}")
    assert sent.returncode == 0, sent.stderr
    tail = qmq(
        "tail", "order.created", "--group", "audit", "--from", "earliest", "--count", "1", "--timeout", "20",
        meta=f"{HOST}:{external}",
    )  # fmt: skip
    assert tail.returncode == 0, tail.stderr
    assert json.loads(tail.stdout.splitlines()[0])["id"] == sent.stdout.strip()

    # Through the internal listener the host is handed broker-x.invalid, which it cannot reach.
    failed = qmq("send", "order.created", "x", "--delivery-timeout", "0", meta=f"{HOST}:{port}")
    assert failed.returncode != 0 and "broker-x.invalid" in failed.stderr, failed.stderr


def test_a_bad_external_address_is_refused_and_the_connection_stays_usable(cluster) -> None:
    port, _, _, conn = cluster
    body = {"kind": "delay", "address": "d.invalid:20890", "external_address": "no-port"}
    with pytest.raises(RemoteError) as exc:
        conn.request(RequestCode.META_HEARTBEAT, body)
    assert exc.value.code == ErrorCode.BAD_REQUEST
    assert "no-port" in exc.value.message
    body["external_address"] = "127.0.0.1:20890"
    assert conn.request(RequestCode.META_HEARTBEAT, body)["read_only"] is False
    with BlockingConnection.open(HOST, port, client_id="listener-test", token="") as other:
        listed = other.request(RequestCode.META_LIST, {})
    assert [s["address"] for s in listed["servers"] if s["kind"] == "delay"] == ["d.invalid:20890"]
    assert all("external_address" not in s for s in listed["servers"])
