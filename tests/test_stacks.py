"""`kill -USR1 PID` asks any qmq process for its threads' stacks (qmq/stacks.py): they go
to its log and the process goes on. The test harness asks a process that does not end after a
signal for them, so a hung stop in CI says where it hung."""

from __future__ import annotations

import signal
import subprocess

import pytest

from qmq.client import Client
from tests.support.processes import thread_stacks

# A qmq process (the same handler as every `qmq` command) that ignores SIGTERM while it waits in a
# function of a name the stacks must show.
STUCK_PROCESS = """
import signal, sys, time
from qmq.stacks import stacks_on_signal
stacks_on_signal()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
def waiting_for_nothing_in_particular():
    print("ready", flush=True)
    while True:
        time.sleep(0.05)
waiting_for_nothing_in_particular()
"""


def test_sigusr1_writes_the_brokers_threads_to_its_log_and_it_goes_on_serving(broker) -> None:
    stacks = thread_stacks(broker.proc)
    assert "most recent call first" in stacks, stacks
    assert "Thread 0x" in stacks or "Current thread 0x" in stacks, stacks
    assert "qmq" in stacks, stacks  # the broker's own frames, not only the interpreter's
    assert broker.proc.poll() is None
    with Client(brokers=[broker.address]) as client:
        client.send_one("stacks.after", {"still": "here"})  # raises SendError if not stored


def test_a_process_that_ignores_its_stop_signal_fails_the_kill_with_its_stacks(processes) -> None:
    proc = processes.start(["-c", STUCK_PROCESS], name="stuck", stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"ready"
    with pytest.raises(AssertionError) as failure:
        processes.kill(proc, signal.SIGTERM, timeout_s=0.5)
    message = str(failure.value)
    assert "did not end within 0.5 s of SIGTERM" in message
    assert "waiting_for_nothing_in_particular" in message, message
    assert proc.poll() is None  # SIGUSR1 did not end it either
