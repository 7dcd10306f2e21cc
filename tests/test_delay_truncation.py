"""A delay server's own files cut back with its message log (delay_server/truncation.py), as when a
deposed master rejoins its group: real files written by a real delay server (deliveries to a real
broker included), cut at an offset, checked file by file, with `qmq log verify`, and after a
restart through the server's own answers."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from delay_server.cancels import iter_cancels
from delay_server.truncation import cut_back
from delay_server.verify import iter_scheduled
from qmq.protocol.codes import RequestCode
from qmq.store.replication import truncate_log
from tests.support.broker import ROOT, start_broker
from tests.support.delay import dispatched_ids, restart_delay_server, start_delay_server
from tests.support.replication import wait_for

HOUR_MS = 3_600_000
PER_PART = 20


def _part(conn, name: str, now_ms: int, fired_before: int, stats) -> tuple[list[str], list[str], list[str]]:
    """Send PER_PART messages due now and PER_PART due in an hour, wait until the first are
    delivered, cancel two of the others: (due now, due later, cancelled) ids."""
    now_ids = [f"{name}-now-{i}" for i in range(PER_PART)]
    later_ids = [f"{name}-later-{i}" for i in range(PER_PART)]
    messages = [{"id": i, "subject": "trunc", "payload": b"x", "deliver_at": now_ms} for i in now_ids]
    messages += [{"id": i, "subject": "trunc", "payload": b"x", "deliver_at": now_ms + HOUR_MS} for i in later_ids]
    assert conn.request(RequestCode.DELAY_SEND, {"messages": messages})["stored"] == 2 * PER_PART
    wait_for(lambda: stats()["fired"] >= fired_before + PER_PART, f"part {name} delivered", 30)
    cancelled = later_ids[:2]
    outcomes = conn.request(RequestCode.DELAY_CANCEL, {"ids": cancelled})["outcomes"]
    assert outcomes == ["cancelled", "cancelled"]  # durable: the dispatch notes before it are too
    return now_ids, later_ids, cancelled


def test_a_cut_log_cuts_buckets_dispatch_logs_and_cancels_with_it(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    now_ms = int(time.time() * 1000)
    with delay.connect() as conn:
        a_now, a_later, a_cancelled = _part(conn, "a", now_ms, 0, delay.stats)
        offset = delay.stats()["filed_upto"]  # the new master's log ends here
        b_now, b_later, b_cancelled = _part(conn, "b", now_ms, PER_PART, delay.stats)
    assert dispatched_ids(delay.data_dir) == set(a_now + b_now)
    processes.kill(delay.proc, signal.SIGTERM)
    delay.proc.wait(timeout=30)

    assert truncate_log(delay.data_dir, offset) > 0
    assert cut_back(delay.data_dir, offset, 60) == 2 * PER_PART + len(b_cancelled)

    assert {r.message_id for _, r in iter_scheduled(delay.data_dir)} == set(a_now + a_later)
    assert dispatched_ids(delay.data_dir) == set(a_now)
    cancels = {r.message_id for path in (delay.data_dir / "cancels").glob("*.log") for r in iter_cancels(path)}
    assert cancels == set(a_cancelled)
    verify = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(delay.data_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr

    delay = restart_delay_server(processes, delay)
    with delay.connect() as conn:
        assert conn.request(RequestCode.DELAY_LOOKUP, {"id": b_later[5]})["messages"] == []
        [kept] = conn.request(RequestCode.DELAY_LOOKUP, {"id": a_later[5]})["messages"]
        assert kept["state"] == "pending"
        # The cut cancel is forgotten (the group never acknowledged it); the kept one holds.
        assert conn.request(RequestCode.DELAY_CANCEL, {"ids": [b_cancelled[0]]})["outcomes"] == ["unknown"]
        [held] = conn.request(RequestCode.DELAY_LOOKUP, {"id": a_cancelled[0]})["messages"]
        assert held["state"] == "cancelled"
    assert delay.stats()["pending"] == PER_PART  # the hour's bucket: part a's; the due-now one is done
