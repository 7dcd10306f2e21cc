"""`qmq admin group show` and `qmq admin group forget` against a real meta server and real brokers
(docs/replication.md): a replica lost for good keeps a group with the default acknowledgement rule
read-only until it is forgotten; the master and a live member are never forgotten by mistake."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from qmq.client import Client, OutgoingMessage
from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from tests.support.broker import restart_broker, start_broker
from tests.support.replication import (
    FAILOVER_AFTER_S,
    MAX_LAG,
    replication,
    wait_for,
    wait_in_sync,
    wait_role,
)

SUBJECT = "members.orders"


def member(processes, data_dir, meta, name):
    """A broker of group g1 with the default acknowledgement rule (1 replica once it has one)."""
    return start_broker(processes, data_dir, "--meta", meta, "--group", "g1", "--max-lag", MAX_LAG, name=name)


def admin(meta: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "admin", "group", *args, "--group", "g1"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QMQ_META": meta, "QMQ_TOKEN": ""},
    )


def silent_for(meta: str, address: str, seconds: float) -> bool:
    host, port = meta.rsplit(":", 1)
    with BlockingConnection.open(host, int(port), client_id="members-test", token="") as conn:
        listing = conn.request(RequestCode.META_LIST, {})["replication"]
    return any(m["address"] == address and m["reported_s_ago"] > seconds for g in listing for m in g["members"])


def test_a_lost_replica_is_forgotten_and_the_group_takes_sends_again(processes, tmp_path, meta) -> None:
    a = member(processes, tmp_path / "a", meta, "a")
    wait_role(a, "master")
    b = member(processes, tmp_path / "b", meta, "b")
    wait_role(b, "replica")
    wait_in_sync(a, b)

    shown = admin(meta, "show", "--json")
    assert shown.returncode == 0, shown.stderr
    view = json.loads(shown.stdout)
    rows = {m["address"]: m for m in view["members"]}
    assert (rows[a.address]["role"], rows[b.address]["role"]) == ("master", "replica")
    assert rows[b.address]["in_sync"] is True and rows[b.address]["says"] == "replica"
    assert rows[a.address]["epoch"] == view["epoch"] == 1
    assert rows[a.address]["durable"] == rows[a.address]["log_end"]
    assert view["ack_rule"]["ack_replicas"] == 1
    text = admin(meta, "show")
    assert text.returncode == 0 and "DURABLE" in text.stdout and b.address in text.stdout

    refused = admin(meta, "forget", "--broker", a.address)
    assert refused.returncode == 1 and "is the master of group g1" in refused.stderr
    refused = admin(meta, "forget", "--broker", b.address)
    assert refused.returncode == 1 and "looks alive" in refused.stderr and "--force" in refused.stderr
    refused = admin(meta, "forget", "--broker", "127.0.0.1:1")
    assert refused.returncode == 1 and "is not a member of group g1" in refused.stderr

    processes.kill(b.proc, signal.SIGKILL)  # the machine is lost
    wait_for(lambda: (replication(a) or {}).get("writable") is False, "the group to turn read-only", timeout=10)
    wait_for(lambda: silent_for(meta, b.address, FAILOVER_AFTER_S), "the replica to fall silent", timeout=10)
    with Client(meta=meta, delivery_timeout_s=0) as client:  # refused now, not offered again
        assert not client.send([OutgoingMessage(SUBJECT, "while-lost")])[0].ok

        done = admin(meta, "forget", "--broker", b.address)
        assert done.returncode == 0, done.stderr
        assert f"forgot {b.address}" in done.stdout
        assert "ack rule now: a send is acknowledged once the master alone has it durable" in done.stdout
        assert (replication(a) or {}).get("writable") is True and not replication(a)["replicas"]
        assert all(r.ok for r in client.send([OutgoingMessage(SUBJECT, f"after-{i}") for i in range(20)]))

        view = json.loads(admin(meta, "show", "--json").stdout)
        assert [m["address"] for m in view["members"]] == [a.address]

        # Not destructive: the member, should it come back after all, rejoins and catches up.
        b = restart_broker(processes, b, name="b-back")
        wait_in_sync(a, b)
        assert all(r.ok for r in client.send([OutgoingMessage(SUBJECT, "rejoined")]))
    view = json.loads(admin(meta, "show", "--json").stdout)
    assert sorted(m["address"] for m in view["members"]) == sorted([a.address, b.address])
