"""Delay servers given directly (`qmq send --delay-server H:P`, `Client(delay_servers=...)`): a
delayed message is stored by that delay server without asking the meta server (issue 19, item 9),
and the messages that need a broker are still routed by the meta server."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from qmq.client import Client, OutgoingMessage
from tests.support.broker import ROOT, start_broker
from tests.support.delay import start_delay_server
from tests.support.ordering import start_cluster
from tests.support.processes import free_port


def test_qmq_send_to_a_delay_server_given_directly_never_asks_the_meta_server(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    nowhere = f"127.0.0.1:{free_port()}"  # no meta server listens here
    env = {**os.environ, "PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": nowhere}
    result = subprocess.run(
        [sys.executable, "-m", "qmq", "send", "orders", "hello", "--delay", "3600", "--delay-server", delay.address],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert delay.stats()["pending"] == 1


def test_a_client_given_a_delay_server_still_asks_the_meta_server_for_an_ordered_queue(processes, tmp_path) -> None:
    """With a meta server and delay servers given directly, a subject whose pending messages are all
    delayed is routed to the delay servers without asking the meta server. An ordered message's queue
    (`orders#N`) is never delayed: it must get its broker group from the meta server, even when the
    same call sends a delayed message of the same subject (it used to fail: "no writable broker group")."""
    meta, [broker] = start_cluster(processes, tmp_path, ["g1"])
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    later = int(time.time() * 1000) + 3_600_000
    with Client(meta=meta, delay_servers=[delay.address]) as client:
        results = client.send(
            [OutgoingMessage("orders", {"n": 1}, order_key="k"), OutgoingMessage("orders", {"n": 2}, deliver_at=later)]
        )
    assert [r.ok for r in results] == [True, True], results
    assert results[0].group == "g1" and results[1].group == delay.address
    assert delay.stats()["pending"] == 1
