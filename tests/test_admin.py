"""`qmq admin` against real brokers and a delay server: every sub-command run as a process, its JSON
checked against what the test sent, dead-lettered and consumed (with a raw consumer, so the
figures are exact), and the refusals and failures an operator meets."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from typing import Any

import pytest

from qmq.client import Client, OutgoingMessage
from qmq.protocol import envelope
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT, RawConsumer, start_broker
from tests.support.delay import start_delay_server
from tests.support.processes import free_port

ADMIN_TIMEOUT_S = 60


def admin(*args: str, expect: int = 0, env: dict[str, str] | None = None) -> Any:
    """`qmq admin ARGS --json` as a process; its JSON (or its stderr when it is expected to fail
    without printing any)."""
    proc = subprocess.run(
        [sys.executable, "-m", "qmq", "admin", *args],
        capture_output=True,
        text=True,
        timeout=ADMIN_TIMEOUT_S,
        env={**os.environ, "PYTHONPATH": str(ROOT), "QMQ_META": "", "QMQ_TOKEN": "", **(env or {})},
    )
    assert proc.returncode == expect, f"exit {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    if "--json" in args and proc.stdout.strip():
        return json.loads(proc.stdout)
    return proc.stdout + proc.stderr


def payload(n: int) -> bytes:
    return envelope.encode({"order": n})


def send(conn, subject: str, items: list[tuple[str, str]]) -> None:
    messages = [{"id": i, "subject": subject, "payload": payload(n), "key": k} for n, (i, k) in enumerate(items)]
    assert conn.request(RequestCode.BROKER_SEND, {"messages": messages})["stored"] == len(items)


def group_row(stats: dict[str, Any], subject: str, group: str) -> dict[str, Any]:
    return next(g for g in stats["groups"] if g["subject"] == subject and g["group"] == group)


def test_every_admin_command_against_real_brokers(processes, tmp_path) -> None:
    b1 = start_broker(processes, tmp_path / "b1", name="b1")
    b2 = start_broker(processes, tmp_path / "b2", name="b2")
    delay = start_delay_server(processes, tmp_path / "d", "--broker", b1.address, name="delay")
    where = ["--broker", b1.address, "--broker", b2.address, "--delay-server", delay.address]
    conn1, conn2 = b1.connect(), b2.connect()
    try:
        send(conn1, "orders", [(f"m{n}", f"k{n}") for n in range(5)])
        send(conn2, "orders", [(f"n{n}", f"k{n}") for n in range(3)])
        consumer = RawConsumer(conn1, "orders", "g", "c1", {"start": "earliest"})
        got = consumer.pull(64, 0)
        assert [d.id for d in got] == [f"m{n}" for n in range(5)]
        consumer.nack(got[3], 0, dead=True, reason="no billing account for customer 42")
        consumer.nack(got[4], 0, dead=True, reason="bad body")
        consumer.ack(got)

        # stats: what was sent, consumed and dead-lettered, summed over both broker groups
        stats = admin("stats", *where, "--json")
        assert {s["subject"]: s["stored"] for s in stats["subjects"]} == {"orders": 8}
        assert [(b["group"], b["ok"]) for b in stats["brokers"]] == [(b1.address, True), (b2.address, True)]
        row = group_row(stats, "orders", "g")
        assert (row["backlog"], row["in_flight"], row["retrying"], row["dead"], row["acked"]) == (0, 0, 0, 2, 5)
        assert "Consumer groups" in admin("stats", *where)  # the tables

        # dead list: ids, reasons, attempts, bodies decoded
        dead = admin("dead", "list", "orders", "g", *where, "--json")
        assert [(m["id"], m["reason"], m["body"]) for m in dead["messages"]] == [
            ("m3", "no billing account for customer 42", {"order": 3}),
            ("m4", "bad body", {"order": 4}),
        ]
        assert {m["broker_group"] for m in dead["messages"]} == {b1.address}

        # lookup by id: stored, pulled by c1, dead; by key on both brokers
        found = admin("lookup", "--id", "m3", *where, "--json")
        [message] = found["messages"]
        assert [e["event"] for e in message["life"]] == ["stored", "pulled", "dead"]
        assert message["life"][1]["consumer"] == "c1"
        assert message["life"][2]["reason"] == "no billing account for customer 42"
        assert message["groups"] == {"g": "dead"}
        by_key = admin("lookup", "--key", "orders", "k1", *where, "--json")
        assert sorted((m["id"], m["groups"].get("g")) for m in by_key["messages"]) == [("m1", "consumed"), ("n1", None)]

        # re-drive one dead letter by id: it comes back at attempt 1 and is consumed
        assert admin("dead", "redrive", "orders", "g", "--id", "m3", "--yes", *where, "--json")["redriven"] == 1
        assert [m["id"] for m in admin("dead", "list", "orders", "g", *where, "--json")["messages"]] == ["m4"]
        again = consumer.pull(64, 5000)
        assert [(d.id, d.attempt) for d in again] == [("m3", 1)]
        consumer.ack(again)
        life = admin("lookup", "--id", "m3", *where, "--json")["messages"][0]
        assert [e["event"] for e in life["life"]] == [
            "stored",
            "pulled",
            "dead",
            "re-driven",
            "pulled",
            "acked",
        ]
        assert life["groups"] == {"g": "consumed"}

        # purge the rest
        assert admin("dead", "purge", "orders", "g", "--yes", *where, "--json")["purged"] == 1
        assert admin("dead", "list", "orders", "g", *where, "--json")["messages"] == []
        assert group_row(admin("stats", *where, "--json"), "orders", "g")["dead"] == 0
        assert admin("lookup", "--id", "m4", *where, "--json")["messages"][0]["groups"] == {"g": "purged"}

        # reset: to the earliest (made on b2, where the group never pulled), then to a time after all
        reset = admin("reset", "orders", "g", "--to", "earliest", "--yes", *where, "--json")
        assert {r["group"]: r["cursor"] for r in reset["broker_groups"]} == {b1.address: 0, b2.address: 0}
        assert group_row(admin("stats", *where, "--json"), "orders", "g")["backlog"] == 8
        later = datetime.now(UTC).isoformat()
        reset = admin("reset", "orders", "g", "--to", later, "--yes", *where, "--json")
        assert {r["group"]: r["cursor"] for r in reset["broker_groups"]} == {b1.address: 5, b2.address: 3}
        assert group_row(admin("stats", *where, "--json"), "orders", "g")["backlog"] == 0

        # group create and delete
        made = admin("group", "create", "orders", "g2", "--from", "earliest", *where, "--json")
        assert [(r["created"], r["cursor"]) for r in made["broker_groups"]] == [(True, 0), (True, 0)]
        made = admin("group", "create", "orders", "g2", *where, "--json")
        assert [r["created"] for r in made["broker_groups"]] == [False, False]
        assert group_row(admin("stats", *where, "--json"), "orders", "g2")["backlog"] == 8
        assert all(
            r["deleted"] for r in admin("group", "delete", "orders", "g2", "--yes", *where, "--json")["broker_groups"]
        )
        assert all(g["group"] != "g2" for g in admin("stats", *where, "--json")["groups"])
        # each broker group decides on its own: b1 refuses (c1 is alive), b2 deletes
        refused = admin("group", "delete", "orders", "g", "--yes", *where, "--json", expect=1)
        assert [e["address"] for e in refused["errors"]] == [b1.address]
        assert "live consumers (c1)" in refused["errors"][0]["error"]
        assert [r.get("deleted") for r in refused["broker_groups"]] == [None, True]
        forced = admin("group", "delete", "orders", "g", "--yes", "--force", *where, "--json")
        assert [r["deleted"] for r in forced["broker_groups"]] == [True, False]

        # inspect: every consumer the brokers know, and a worker's report from its heartbeat
        again = RawConsumer(conn2, "orders", "g3", "w1@host", {"start": "earliest"})
        assert len(again.pull(2, 0)) == 2
        report = {
            "host": "host",
            "pid": 4242,
            "app": "billing",
            "pool": "threads",
            "concurrency": 8,
            "running": [{"id": "n0", "subject": "orders", "group": "g3", "attempt": 1, "started_at": 1}],
        }
        conn2.request(RequestCode.BROKER_HEARTBEAT, {"consumers": [["orders", "g3", "w1@host"]], "worker": report})
        view = admin("inspect", *where, "--json")
        [worker] = view["workers"]
        assert (worker["consumer"], worker["pid"], worker["concurrency"], worker["in_flight"]) == (
            "w1@host",
            4242,
            8,
            2,
        )
        assert worker["running"][0]["id"] == "n0"
        assert {(c["group"], c["consumer"], c["in_flight"]) for c in view["consumers"]} >= {("g3", "w1@host", 2)}
        assert "w1@host" in admin("inspect", *where)
    finally:
        conn1.close()
        conn2.close()

    # a delayed message: on the delay server, pending
    with Client(brokers=[b1.address], delay_servers=[delay.address]) as client:
        [result] = client.send(
            [OutgoingMessage("orders", {"order": 9}, key="k9", deliver_at=int(time.time() * 1000) + 3_600_000)]
        )
    delayed = admin("lookup", "--id", result.message_id, *where, "--json")
    assert delayed["messages"] == []
    assert [(d["state"], d["body"]) for d in delayed["delayed"]] == [("pending", {"order": 9})]

    # not found: exit 1; a broker down: what the others said, and exit 1
    assert "not found" in admin("lookup", "--id", "nope", *where, expect=1)
    down = f"127.0.0.1:{free_port()}"
    stats = admin("stats", *where, "--broker", down, "--json", expect=1)
    assert [e["address"] for e in stats["errors"]] == [down]
    assert {s["subject"]: s["stored"] for s in stats["subjects"]} == {"orders": 8}
    # an action without --yes and without a terminal is refused, and changes nothing
    assert "--yes" in admin("dead", "purge", "orders", "g", *where, expect=2)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["lookup"], "give --id ID or --key SUBJECT KEY"),
        (["reset", "orders", "g", "--to", "sometime", "--yes"], "is not a position: give earliest, latest"),
        (["stats", "--meta", "127.0.0.1:1", "--broker", "127.0.0.1:2"], "give --meta or --broker, not both"),
        (["dead", "list", "bad subject!", "g", "--broker", "127.0.0.1:1"], "did not answer"),
    ],
)
def test_bad_input_is_named(args: list[str], message: str) -> None:
    assert message in admin(*args, expect=1 if args[0] == "dead" else 2)
