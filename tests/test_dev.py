"""`qmq dev`: one command brings up a meta server, a broker group, the delay server and a relay that a
producer and a consumer can use at once; Ctrl-C takes every one of them down."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import qmq
from qmq.client.blocking import Client
from qmq.db.engine import create_engine
from tests.support.broker import ROOT
from tests.test_meta import log_text, wait_until


def test_the_dev_cluster_serves_and_stops_on_ctrl_c(processes, tmp_path) -> None:
    dev = processes.start(
        [
            "-m",
            "qmq",
            "dev",
            "--data-dir",
            str(tmp_path / "dev"),
            "--meta-port",
            "0",
            "--broker-port",
            "0",
            "--delay-port",
            "0",
        ],
        name="dev",
        env={"PYTHONPATH": str(ROOT), "QMQ_DB_URL": "", "QMQ_META": ""},
    )
    text = wait_until(
        lambda: "Ctrl-C stops everything" in log_text(dev) and log_text(dev), "the cluster is up", deadline_s=60
    )
    meta = re.search(r"QMQ_META=(\S+)", text).group(1)
    outbox_url = re.search(r"QMQ_DB_URL=(\S+)", text).group(1)
    children = subprocess.run(["pgrep", "-P", str(dev.pid)], capture_output=True, text=True).stdout.split()
    assert len(children) == 4  # meta, broker, delay server, relay

    engine = create_engine(outbox_url)
    producer = qmq.Producer(meta=meta, engine=engine, after_commit=False)  # left to the cluster's relay
    relayed = producer.send("dev.check", {"via": "relay"})
    producer.close()
    with Client(meta=meta) as client:
        direct = client.send_one("dev.check", {"via": "client"}).message_id
        sub = client.subscribe("dev.check", "dev-test", start="earliest")
        got = []
        wait_until(lambda: got.extend(sub.pull(10, 0.5)) or len(got) >= 2, "both messages arrive")
        assert sorted(d.id for d in got) == sorted([relayed, direct])
        sub.close()
    engine.dispose()

    os.killpg(dev.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole process group
    assert dev.wait(30) == 0
    for pid in children:
        assert subprocess.run(["kill", "-0", pid], capture_output=True).returncode != 0, f"{pid} still runs"
