"""`qmq send --delay-server H:P` with a delay: stored by that delay server without asking the meta
server (issue 19, item 9): here the meta server named by QMQ_META does not exist at all."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.broker import ROOT, start_broker
from tests.support.delay import start_delay_server
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
