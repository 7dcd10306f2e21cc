"""`qmq delay-server` as a real process between real clients and real brokers: messages at random
times arrive on time and never early, through a SIGKILL too; months ahead with the shifted clock;
the limit, cancels, `qmq send --delay`, and a broker that is down when messages come due."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from datetime import UTC, datetime, timedelta

from delay_server.parking import PROBE_BACKOFF_S
from delay_server.schedule_log import bucket_name
from delay_server.scheduler import RETRY_BACKOFF_S
from qmq.admin.views import delay_view
from qmq.client import Client, OutgoingMessage, SendResult
from qmq.client.blocking import Admin
from qmq.protocol.errors import ErrorCode
from tests.support.broker import ROOT, restart_broker, start_broker
from tests.support.delay import Arrivals, dispatched_ids, restart_delay_server, start_delay_server
from tests.support.metrics import sample
from tests.support.processes import free_port
from tests.test_meta import log_text, start_meta, wait_until

MESSAGES = 2000
SPREAD_S = 30.0
DAY_MS = 86_400_000


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def p99(values: list[int]) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


def send_spread(client: Client, subject: str, count: int, spread_s: float) -> dict[str, int]:
    """`count` messages due at random times over the next `spread_s` seconds: id -> due ms."""
    return spread(client, subject, count, spread_s)[0]


def spread(client: Client, subject: str, count: int, spread_s: float) -> tuple[dict[str, int], list[SendResult]]:
    """`send_spread`, with the send's results: a message already due when the client sent it (a
    loaded machine can take longer than the lead) went to the broker, not to a delay server."""
    start = now_ms() + 500
    rng = random.Random(subject)
    messages = [
        OutgoingMessage(subject, f"n{i}", deliver_at=start + int(rng.random() * spread_s * 1000)) for i in range(count)
    ]
    results = client.send(messages)
    assert all(r.ok for r in results), [r for r in results if not r.ok][:3]
    return {m.id: m.deliver_at for m in messages}, results


def test_2000_at_random_times_arrive_on_time_and_survive_a_sigkill(processes, tmp_path) -> None:
    """Two delay servers side by side, 2,000 messages each at random times over 30 s: the first
    runs undisturbed (all arrive, none early, stored on the broker within 1 s of their due time at
    p99); the second is SIGKILLed half-way and restarted (none lost; none its dispatch log recorded
    arrives twice)."""
    broker = start_broker(processes, tmp_path / "broker")
    steady = start_delay_server(processes, tmp_path / "steady", "--broker", broker.address)
    crashing = start_delay_server(processes, tmp_path / "crashing", "--broker", broker.address)
    consumer_client = Client(brokers=[broker.address])
    on_time = Arrivals(consumer_client, "delay.steady")
    crashed = Arrivals(consumer_client, "delay.crashing")
    try:
        with Client(brokers=[broker.address], delay_servers=[steady.address]) as client:
            due_steady = send_spread(client, "delay.steady", MESSAGES, SPREAD_S)
        with Client(brokers=[broker.address], delay_servers=[crashing.address]) as client:
            due_crashing, results = spread(client, "delay.crashing", MESSAGES, SPREAD_S)
        held = sum(r.group == crashing.address for r in results)  # the rest was due already: to the broker

        wait_until(lambda: crashed.count() >= MESSAGES // 3, "a third of the messages delivered", SPREAD_S)
        processes.kill(crashing.proc)
        recorded = dispatched_ids(crashing.data_dir)
        assert recorded, "the dispatch log recorded nothing before the kill"
        restart_delay_server(processes, crashing)

        missing = on_time.wait_for(set(due_steady), SPREAD_S + 15)
        assert not missing, f"{len(missing)} of {MESSAGES} messages never arrived"
        missing = crashed.wait_for(set(due_crashing), SPREAD_S + 15)
        assert not missing, f"{len(missing)} of {MESSAGES} messages lost across the SIGKILL"
        time.sleep(1.0)  # a duplicate would come right after the last message; give it the chance
    finally:
        on_time.close()
        crashed.close()
        consumer_client.close()

    early = [i for i, due in due_steady.items() if on_time.stored_at[i] < due]
    assert not early, f"{len(early)} messages reached the broker before they were due"
    # Lateness is the delay server's: due to stored on the broker. The consumer here shares the
    # test's process and the loaded machine: on CI its receipt added 0.9 s at p99 (stored p99 0.3 s).
    lateness = [on_time.stored_at[i] - due for i, due in due_steady.items()]
    assert p99(lateness) < 1000, f"lateness p99 {p99(lateness)} ms"
    assert all(len(times) == 1 for times in on_time.received.values())

    early = [i for i, due in due_crashing.items() if crashed.stored_at[i] < due]
    assert not early, f"{len(early)} messages reached the broker before they were due"
    twice = [i for i in recorded if len(crashed.received[i]) > 1]
    assert not twice, f"{len(twice)} messages the dispatch log recorded were delivered again"

    verify = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(crashing.data_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert f" {held} scheduled" in verify.stdout  # every message it acknowledged, after the SIGKILL too


def test_400_days_ahead_limit_cancel_and_qmq_send(processes, tmp_path) -> None:
    clock_file = tmp_path / "clock-offset"
    _meta_proc, meta_port = start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}")
    meta = f"127.0.0.1:{meta_port}"
    start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "g1")
    delay = start_delay_server(processes, tmp_path / "delay", "--meta", meta, "--clock-file", str(clock_file))
    client = Client(meta=meta)
    wait_until(
        lambda: client.route("trip.reminder", refresh=True).delay_route.writable_groups, "the delay server registered"
    )
    arrivals = Arrivals(client, "trip.reminder")
    try:
        far = now_ms() + 400 * DAY_MS
        soon = datetime.now(UTC) + timedelta(seconds=2)
        far_msg = OutgoingMessage("trip.reminder", "in 400 days", deliver_at=far)
        beyond = OutgoingMessage("trip.reminder", "in 800 days", deliver_at=now_ms() + 800 * DAY_MS)
        keep = OutgoingMessage("trip.reminder", "keep", deliver_at=soon)
        dropped = OutgoingMessage("trip.reminder", "cancelled", deliver_at=soon)
        results = client.send([far_msg, beyond, keep, dropped])
        assert [r.ok for r in results] == [True, False, True, True]
        assert results[1].error_code == ErrorCode.BAD_REQUEST
        assert "800.0 days ahead" in results[1].error and "at most 730 days" in results[1].error

        bucket = bucket_name(far - far % 3_600_000)
        assert delay.stats()["buckets"][bucket] == 1
        assert (delay.data_dir / "schedule" / f"{bucket}.log").exists()

        assert client.cancel([dropped.id, "no-such-id"]) == {dropped.id: "cancelled", "no-such-id": "unknown"}
        sent = subprocess.run(
            [sys.executable, "-m", "qmq", "send", "trip.reminder", "from the cli", "--delay", "1", "--meta", meta],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert sent.returncode == 0, sent.stderr
        cli_id = sent.stdout.strip()

        assert not arrivals.wait_for({keep.id, cli_id}, 20)
        wait_until(lambda: delay.stats()["skipped"] == 1, "the cancelled message was dropped")
        assert client.cancel([keep.id]) == {keep.id: "too_late"}
        assert far_msg.id not in arrivals.received

        clock_file.write_text(str((far - now_ms()) / 1000 - 3))  # the server's clock: 3 s before it is due
        assert not arrivals.wait_for({far_msg.id}, 20)
        stats = delay.stats()
        assert stats["clock_offset_ms"] > 399 * DAY_MS
        assert stats["fired"] == 3 and stats["skipped"] == 1
        bucket_end = far - far % 3_600_000 + 3_600_000
        clock_file.write_text(str((bucket_end - now_ms()) / 1000 + 1))  # the bucket's hour is over
        wait_until(lambda: (delay.data_dir / "dispatch" / f"{bucket}.done").exists(), "the far bucket marked done")
    finally:
        arrivals.close()
        client.close()
    assert dropped.id not in arrivals.received
    assert arrivals.bodies[far_msg.id] == "in 400 days"

    dump = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "dump", "--data-dir", str(delay.data_dir), "--schedule"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert dump.returncode == 0, dump.stderr
    far_copy = [json.loads(line) for line in dump.stdout.splitlines() if far_msg.id in line]
    assert len(far_copy) == 1 and far_copy[0]["bucket"] == bucket
    assert far_copy[0]["due_at"] == datetime.fromtimestamp(far / 1000, tz=UTC).isoformat(timespec="milliseconds")


def received_after_restart(processes, broker, subject: str, ids: set[str]) -> Arrivals:
    """Restart the killed `broker` and consume `subject` from it until every one of `ids` arrived."""
    broker = restart_broker(processes, broker)
    consumer_client = Client(brokers=[broker.address])
    arrivals = Arrivals(consumer_client, subject)
    try:
        assert not arrivals.wait_for(ids, 60)
    finally:
        arrivals.close()
        consumer_client.close()
    return arrivals


def test_messages_due_during_a_broker_outage_go_within_a_probe_interval_of_its_end(processes, tmp_path) -> None:
    """No broker takes the subject (a group failing over, here its only broker killed): the due
    messages wait together and a batch of them is tried every PROBE_BACKOFF_S (2 s at most), not each
    on a backoff of its own (which after six failures waits 30 s). So once the broker is back they
    are stored within about one probe interval, however long the outage was (delay_server/parking.py)."""
    broker = start_broker(processes, tmp_path / "broker")
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    processes.kill(broker.proc)  # before anything comes due
    with Client(brokers=[broker.address], delay_servers=[delay.address]) as client:
        due = send_spread(client, "delay.parked", 50, 1.0)
    wait_until(lambda: delay.stats()["failures"] >= len(due), "every message tried once", 60)
    # The outage's length is what is tested (no event to await): past the sixth try, alone each
    # message would next be tried 30 s later; parked, its subject is probed every 2 s.
    time.sleep(sum(RETRY_BACKOFF_S[:5]) + 1.5)
    stats = delay.stats()
    assert stats["fired"] == 0 and stats["parked"] > 0 and list(stats["parked_subjects"]) == ["delay.parked"]
    with Admin(brokers=[broker.address], delay_servers=[delay.address]) as admin:  # what the console shows
        [server] = delay_view(admin.delay_stats())["servers"]
    assert server["parked"] > 0 and [p["subject"] for p in server["parked_subjects"]] == ["delay.parked"]
    back_ms = now_ms()  # the restart begins
    arrivals = received_after_restart(processes, broker, "delay.parked", set(due))
    assert all(len(times) == 1 for times in arrivals.received.values())
    late_s = (max(arrivals.stored_at.values()) - back_ms) / 1000
    assert late_s < PROBE_BACKOFF_S[-1] + 8.0, f"stored {late_s:.1f} s after the broker's restart began"
    assert delay.stats()["parked"] == 0 and delay.stats()["parked_subjects"] == {}


BACKLOG = 3000
MAX_HELD = 300


def test_a_backlog_due_at_once_is_read_from_disk_max_held_at_a_time(processes, tmp_path) -> None:
    """3,000 messages due in a minute, then the server's clock moved two minutes on, as after an
    outage or a restart with a backlog: all are due at once. Each is delivered once, and no more than
    --max-held of them are read from disk and not yet delivered at any moment (before, all were read
    at once: a million overdue messages held a gigabyte and the event loop for seconds)."""
    clock_file = tmp_path / "clock-offset"
    broker = start_broker(processes, tmp_path / "broker")
    delay = start_delay_server(
        processes,
        tmp_path / "delay",
        "--broker",
        broker.address,
        "--clock-file",
        str(clock_file),
        "--max-held",
        str(MAX_HELD),
    )
    start = now_ms() + 60_000
    messages = [OutgoingMessage("delay.backlog", f"n{i}", deliver_at=start + i * 10) for i in range(BACKLOG)]
    with Client(brokers=[broker.address], delay_servers=[delay.address]) as client:
        assert all(r.ok for r in client.send(messages))
    wait_until(lambda: delay.stats()["wheel"] == BACKLOG, "every message in the wheel", 30)
    clock_file.write_text("120")
    consumer_client = Client(brokers=[broker.address])
    arrivals = Arrivals(consumer_client, "delay.backlog")
    try:
        assert not arrivals.wait_for({m.id for m in messages}, 60)
    finally:
        arrivals.close()
        consumer_client.close()
    assert all(len(times) == 1 for times in arrivals.received.values())
    stats = delay.stats()
    assert stats["fired"] == BACKLOG and stats["held"] == stats["due_waiting"] == 0 and stats["max_held"] == MAX_HELD
    assert MAX_HELD // 2 <= stats["held_peak"] <= MAX_HELD, stats["held_peak"]


def test_broker_down_when_messages_come_due_then_metrics_and_sigterm(processes, tmp_path) -> None:
    broker = start_broker(processes, tmp_path / "broker")
    metrics_port = free_port()
    delay = start_delay_server(
        processes, tmp_path / "delay", "--broker", broker.address, "--metrics-port", str(metrics_port)
    )
    processes.kill(broker.proc)  # before anything comes due
    with Client(brokers=[broker.address], delay_servers=[delay.address]) as client:
        due = send_spread(client, "delay.outage", 50, 1.0)
    wait_until(lambda: delay.stats()["failures"] > 0, "deliveries failed while the broker was down", 20)
    assert delay.stats()["fired"] == 0
    received_after_restart(processes, broker, "delay.outage", set(due))
    assert delay.stats()["fired"] == 50

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            return reply.read().decode()

    text = wait_until(lambda: (t := scrape()) and "qmq_delay_pending{bucket=" in t and t, "the pending gauge")
    assert "qmq_delay_fired_total 50.0" in text
    assert "qmq_delay_lateness_seconds_count 50.0" in text
    assert "qmq_delay_delivery_failures_total" in text
    flusher = sample(text, "qmq_delay_fsyncs_total", thread="flusher")
    assert flusher is not None and flusher >= 1  # the 50 messages were durable before they were accepted
    assert sample(text, "qmq_delay_fsync_seconds_count") >= flusher
    delay.proc.send_signal(signal.SIGTERM)
    assert delay.proc.wait(timeout=30) == 0
    assert "delay server stopped" in log_text(delay.proc)
