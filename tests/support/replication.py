"""Replicated broker groups as real processes (docs/replication.md): a meta server on a database of
its own with short failover settings, brokers that join a group, and their roles read from
BROKER_STATS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from qmq.net.client import BlockingConnection
from qmq.protocol.codes import RequestCode
from tests.support.broker import ROOT, Broker, start_broker
from tests.support.delay import start_delay_server
from tests.support.processes import free_port, wait_for_port
from tests.support.waiting import wait_until

HOST = "127.0.0.1"
# Short, so tests fail over in seconds. A master fences itself after half of it without a meta reply,
# which with heartbeats every quarter is a reply half a second late at 2 s: a loaded CI machine
# (compose build, Spark) gave one (a send refused as "fenced"); 3 s allows 0.75 s.
FAILOVER_AFTER_S = 3.0
MAX_LAG_S = 2.0  # short, so a lost replica turns its group read-only soon; long enough for a loaded CI machine
MAX_LAG = f"{MAX_LAG_S:g}s"


def start_meta(processes, db_url: str, *args: str, port: int | None = None, name: str = "meta") -> tuple[Any, int]:
    port = port or free_port()
    proc = processes.start(
        ["-m", "qmq", "meta", "--port", str(port), "--db", db_url, "--failover-after", str(FAILOVER_AFTER_S), *args],
        name=name,
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": ""},
    )
    wait_for_port(port, proc)
    return proc, port


def start_member(
    processes, data_dir: Path, meta: str, group: str, *args: str, port: int | None = None, name: str = "broker"
) -> Broker:
    return start_broker(
        processes,
        data_dir,
        "--meta",
        meta,
        "--group",
        group,
        "--ack-replicas",
        "1",
        "--max-lag",
        MAX_LAG,
        *args,
        port=port,
        name=name,
    )


def start_delay_member(
    processes, data_dir: Path, meta: str, name: str, *args: str, ack_replicas: str = "1", env: dict | None = None
) -> Broker:
    """A delay server joining group `d1` (the `delay:d1` of the meta server), as `start_member` starts
    a broker."""
    return start_delay_server(
        processes,
        data_dir,
        "--meta",
        meta,
        "--group",
        "d1",
        "--ack-replicas",
        ack_replicas,
        "--max-lag",
        MAX_LAG,
        *args,
        name=name,
        env=env,
    )


def replication(broker: Broker) -> dict[str, Any] | None:
    """The broker's (or delay server's) replication stats, or None while it cannot answer."""
    try:
        with BlockingConnection.open(HOST, broker.port, client_id="repl-test", token="", timeout=2) as conn:
            return conn.request(broker.stats_code, {}, timeout=5).get("replication")
    except (OSError, ConnectionError, TimeoutError):
        return None


def wait_for(condition, what: str, timeout: float = 60.0):
    return wait_until(condition, what, timeout)


def wait_role(broker: Broker, role: str, timeout: float = 60.0, epoch: int | None = None) -> dict[str, Any]:
    def check():
        stats = replication(broker)
        if stats and stats["role"] == role and (epoch is None or stats["epoch"] >= epoch):
            return stats
        return None

    return wait_for(check, f"{broker.address} to be {role}", timeout)


def meta_request(meta: str, code: int, body: dict[str, Any]) -> dict[str, Any]:
    """One request to the first meta server of `meta` (they share the database: any of them knows)."""
    host, port = meta.split(",")[0].rsplit(":", 1)
    with BlockingConnection.open(host, int(port), client_id="repl-test", token="") as conn:
        return conn.request(code, body)


def meta_in_sync(meta: str, group: str, replica: Broker, timeout: float = 30.0) -> None:
    """Wait until the meta server heard from the master that `replica` is in sync (so it may promote it)."""

    def check():
        listing = meta_request(meta, RequestCode.META_LIST, {})["replication"]
        return any(g["group"] == group and replica.address in g["in_sync"] for g in listing)

    wait_for(check, f"the meta server to know {replica.address} is in sync", timeout)


def wait_in_sync(master: Broker, replica: Broker, timeout: float = 60.0) -> dict[str, Any]:
    def check():
        stats = replication(master)
        if not stats or stats["role"] != "master":
            return None
        for r in stats.get("replicas", ()):
            if r["address"] == replica.address and r["in_sync"]:
                return stats
        return None

    return wait_for(check, f"{replica.address} in sync with {master.address}", timeout)


def admin_failover(meta: str, group: str, old: Broker, new: Broker) -> dict[str, Any]:
    """`qmq admin failover --group GROUP`: checks that it moved the group from `old` to `new` (epoch
    2), that `new` serves as master and `old` rejoined as replica; the command's JSON answer."""
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "admin", "failover", "--group", group, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "QMQ_META": meta, "QMQ_TOKEN": ""},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    switched = json.loads(done.stdout)
    assert (switched["old_master"], switched["master"], switched["epoch"]) == (old.address, new.address, 2)
    assert replication(new)["role"] == "master"
    wait_role(old, "replica", epoch=2)
    return switched


def start_group(processes, tmp_path: Path, meta: str, group: str = "g1", *args: str) -> tuple[Broker, Broker]:
    """A master (a) and an in-sync replica (b) of `group` (each started with `args`), the meta
    server knowing b in sync."""
    a = start_member(processes, tmp_path / "a", meta, group, *args, name="a")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, group, *args, name="b")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, group, b)
    return a, b
