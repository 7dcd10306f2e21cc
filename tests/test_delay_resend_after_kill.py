"""A delay server killed after storing a batch and before its producer saw the reply gets the same
ids again from the producer: each is stored (scheduled) once and delivered once (issue 19, item 9;
it used to be stored, and delivered, twice)."""

from __future__ import annotations

import time

from qmq.protocol.codes import RequestCode
from tests.support.broker import RawConsumer, start_broker
from tests.support.delay import restart_delay_server, start_delay_server

COUNT = 200
DUE_IN_MS = 4000
DEADLINE_S = 40.0


def test_ids_sent_again_after_a_kill_are_stored_and_delivered_once(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    due = int(time.time() * 1000) + DUE_IN_MS
    messages = [{"id": f"d-{i}", "subject": "reminders", "payload": b"x", "deliver_at": due + i} for i in range(COUNT)]
    with delay.connect() as conn:
        assert conn.request(RequestCode.DELAY_SEND, {"messages": messages})["stored"] == COUNT
    processes.kill(delay.proc)  # as if the reply had been lost with the process
    delay = restart_delay_server(processes, delay)
    with delay.connect() as conn:  # the producer sends the batch again
        assert conn.request(RequestCode.DELAY_SEND, {"messages": messages})["stored"] == COUNT
    assert delay.stats()["pending"] == COUNT

    with broker.connect() as conn:
        consumer = RawConsumer(conn, "reminders", "g", "c", {"start": "earliest"})
        got: list[str] = []
        deadline = time.monotonic() + DEADLINE_S
        while len(got) < COUNT and time.monotonic() < deadline:
            got.extend(d.id for d in consumer.pull(256, wait_ms=1000))
        assert sorted(got) == sorted(m["id"] for m in messages)
        got.extend(d.id for d in consumer.pull(256, wait_ms=1500))  # a second copy would follow
    assert len(got) == COUNT, f"{len(got) - COUNT} delivered twice"
