"""Replicated broker groups with real processes, real sockets and real SIGKILL (docs/replication.md):
a master and a replica under one meta server on PostgreSQL, `--ack-replicas 1`, short failover."""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import sqlalchemy as sa

from qmq.client import Client, OutgoingMessage
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.broker import RawConsumer, restart_broker, send
from tests.support.databases import fresh_database
from tests.support.metrics import sample, scrape
from tests.support.processes import free_port, wait_for_port
from tests.support.replication import (
    HOST,
    MAX_LAG_S,
    admin_failover,
    meta_in_sync,
    replication,
    start_group,
    start_member,
    start_meta,
    wait_for,
    wait_in_sync,
    wait_role,
)
from tests.support.stores import assert_log_verifies
from worker.liveness import BacklogProbe

# The full size is 50,000: QMQ_REPL_MESSAGES=50000 .venv/bin/python -m pytest tests/test_replication.py
MESSAGES = int(os.environ.get("QMQ_REPL_MESSAGES", "5000"))
BATCH = 50
SUBJECT = "repl.orders"


class Producer(threading.Thread):
    """Sends `count` messages in batches; a batch's failed messages are sent again (same ids) until
    every one is acknowledged. `acked` holds the ids a broker acknowledged, in order."""

    def __init__(self, meta: str, count: int, kill_at: int | None = None, kill=None) -> None:
        super().__init__(daemon=True)
        self.kill_at, self.kill = kill_at, kill
        self.acked_at_kill: set[str] | None = None
        self.client = Client(meta=meta)
        self.count = count
        self.acked: list[str] = []
        self.sent_ids: set[str] = set()
        self.failures: list[int] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            for start in range(0, self.count, BATCH):
                batch = [OutgoingMessage(SUBJECT, f"m{i}", key=str(i)) for i in range(start, start + BATCH)]
                self.sent_ids.update(m.id for m in batch)
                while batch:
                    results = self.client.send(batch)
                    self.acked.extend(r.message_id for r in results if r.ok)
                    if self.kill_at is not None and self.acked_at_kill is None and len(self.acked) >= self.kill_at:
                        self.kill()  # right after an acknowledgement: the replica must have it already
                        self.acked_at_kill = set(self.acked)
                    self.failures.extend(r.error_code for r in results if not r.ok)
                    failed = {r.message_id for r in results if not r.ok}
                    batch = [m for m in batch if m.id in failed]
        except BaseException as exc:  # reported by the test
            self.error = exc
        finally:
            self.client.close()


def consume(meta: str, want: set[str], *, until: int | None = None, timeout: float = 90.0) -> list[str]:
    """Consume SUBJECT as group "c" (acking each) until every id of `want` came, or `until` messages."""
    got: list[str] = []
    seen: set[str] = set()
    deadline = time.monotonic() + timeout
    with Client(meta=meta) as client, client.subscribe(SUBJECT, "c", start="earliest") as sub:
        while time.monotonic() < deadline:
            if until is not None and len(got) >= until:
                break
            if until is None and want <= seen:
                break
            for delivery in sub.pull(max=256, wait_s=1.0):
                got.append(delivery.id)
                seen.add(delivery.id)
                sub.ack(delivery)
        sub.flush()
    return got


def test_master_lost_with_its_disk_replica_takes_over_nothing_acknowledged_is_lost(processes, tmp_path, meta) -> None:
    a, b = start_group(processes, tmp_path, meta)
    kill_at = random.randint(MESSAGES // 4, MESSAGES // 2)
    producer = Producer(meta, MESSAGES, kill_at, lambda: processes.kill(a.proc, signal.SIGKILL))
    producer.start()
    wait_for(lambda: len(producer.acked) >= MESSAGES // 5, "a fifth acknowledged")
    first = consume(meta, set(), until=MESSAGES // 10)  # a consumer group half-way through
    wait_for(lambda: producer.acked_at_kill is not None, f"the master killed after {kill_at} acknowledged")
    acked_at_crash = producer.acked_at_kill
    shutil.rmtree(a.data_dir)  # the machine is lost, disk and all

    promoted = wait_role(b, "master", epoch=2)
    assert promoted["epoch"] == 2
    a = restart_broker(processes, a, name="a-wiped")  # a new, empty replica catches up from offset 0
    wait_role(a, "replica", epoch=2)
    wait_in_sync(b, a)
    producer.join(timeout=120)
    assert producer.error is None, producer.error
    assert not producer.is_alive()
    acked = set(producer.acked)
    assert len(acked) == MESSAGES

    rest = consume(meta, acked - set(first))
    consumed = first + rest
    assert acked <= set(consumed), f"{len(acked - set(consumed))} acknowledged messages lost"
    assert set(consumed) <= producer.sent_ids
    duplicates = {i for i in consumed if consumed.count(i) > 1} if len(consumed) != len(set(consumed)) else set()
    # A message consumed twice was either not yet acknowledged to the producer when the master died
    # (sent again, maybe stored twice) or consumed before the crash (its ack may not have reached the
    # replica, so it is delivered again).
    assert duplicates <= (producer.sent_ids - acked_at_crash) | set(first)
    stats = replication(b)
    assert stats["role"] == "master" and stats["replicas"][0]["address"] == a.address


def test_a_send_during_a_failover_is_stored_once_the_group_takes_sends_again(processes, tmp_path, meta) -> None:
    """A client keeps offering a message while its group cannot store it (Kafka's
    delivery.timeout.ms): the send that meets the killed master returns once the promoted replica
    takes sends again (here, with `--ack-replicas 1`, once the old master is back as its replica), in
    one call. With `delivery_timeout_s=0` the same send fails after its three attempts."""
    a, b = start_group(processes, tmp_path, meta)
    with Client(meta=meta) as patient, Client(meta=meta, delivery_timeout_s=0) as impatient:
        for client in (patient, impatient):
            assert client.send([OutgoingMessage(SUBJECT, "before")])[0].ok  # both have a's route now
        processes.kill(a.proc, signal.SIGKILL)
        [failed] = impatient.send([OutgoingMessage(SUBJECT, "impatient")])
        assert not failed.ok and failed.error_code == ErrorCode.UNAVAILABLE, failed
        assert "not stored after 3 attempts" in failed.error
        with ThreadPoolExecutor(1) as pool:
            sending = pool.submit(patient.send, [OutgoingMessage(SUBJECT, "during")])
            wait_role(b, "master", epoch=2)
            assert not sending.done()  # b takes no send without a replica in sync
            a = restart_broker(processes, a)
            wait_role(a, "replica", epoch=2)
            [result] = sending.result(timeout=60)
    assert result.ok and result.group == "g1", result.error
    assert result.message_id in consume(meta, {result.message_id})


def test_replica_lost_group_turns_read_only_consumers_go_on_and_it_catches_up(processes, tmp_path, meta) -> None:
    a, b = start_group(processes, tmp_path, meta)
    with Client(meta=meta) as client:
        results = client.send([OutgoingMessage(SUBJECT, f"before-{i}") for i in range(200)])
        assert all(r.ok for r in results)
        before = {r.message_id for r in results}
        processes.kill(b.proc, signal.SIGKILL)
        lost_at = time.monotonic()

        def read_only():
            stats = replication(a)
            return stats if stats and stats.get("writable") is False else None

        wait_for(read_only, "the group to turn read-only", timeout=10)
        assert time.monotonic() - lost_at < MAX_LAG_S + 2.0  # --max-lag, plus the master's check interval
        client.delivery_timeout_s = 0  # refused now, not offered again until the replica is back
        refused = client.send([OutgoingMessage(SUBJECT, "while-alone")])
        assert not refused[0].ok and refused[0].error_code in (ErrorCode.READ_ONLY, ErrorCode.UNAVAILABLE)
        assert set(consume(meta, before, timeout=30)) >= before  # consumers keep reading

        # Meanwhile the log grows (consumer journal); the replica comes back and catches up.
        b = restart_broker(processes, b, name="b-back")
        wait_in_sync(a, b)
        wait_for(lambda: (replication(a) or {}).get("writable"), "the group to take sends again")
        again = client.send([OutgoingMessage(SUBJECT, f"after-{i}") for i in range(50)])
        assert all(r.ok for r in again)
    stats_a, stats_b = replication(a), replication(b)
    assert stats_b["log_end"] <= stats_a["log_end"]


def group_stats(broker, subject: str, group: str) -> dict | None:
    """The broker's BROKER_STATS entry of (subject, group), or None while it cannot answer."""
    try:
        with broker.connect() as conn:
            groups = conn.request(RequestCode.BROKER_STATS, {}, timeout=5)["groups"]
    except (OSError, ConnectionError, TimeoutError, RemoteError):
        return None
    return next((g for g in groups if (g["subject"], g["group"]) == (subject, group)), None)


def test_a_consumer_acknowledges_to_the_new_master_what_the_old_one_handed_out(processes, tmp_path, meta) -> None:
    """The pull logs replicate with the group's journal: what a consumer holds when the group's master
    is lost is acknowledged to the new master (acks that found no master go again), so nothing it
    finished is delivered again. Before, its acks went to the lost master's address, failed, and the
    new master delivered everything it held a second time."""
    a, b = start_group(processes, tmp_path, meta)
    subject = "repl.follow"
    with Client(meta=meta) as client, client.subscribe(subject, "c", start="earliest") as sub:
        assert all(r.ok for r in client.send([OutgoingMessage(subject, f"m{i}") for i in range(40)]))
        held = []
        while len(held) < 40:
            held += sub.pull(max=40, wait_s=1.0)
        for delivery in held[:10]:
            sub.ack(delivery)
        sub.flush()
        end = replication(a)["log_end"]  # the pulls and those acks are journalled here...
        wait_for(lambda: (replication(b) or {}).get("durable", 0) >= end, "the replica to hold the pulls")
        processes.kill(a.proc, signal.SIGKILL)
        for delivery in held[10:30]:  # finished while the group has no master
            sub.ack(delivery)
        sub.flush()
        wait_role(b, "master", epoch=2)
        for delivery in held[30:]:
            sub.ack(delivery)
        again: list[str] = []

        def settled():
            for delivery in sub.pull(max=64, wait_s=0.2):  # (acks go out beside each pull)
                again.append(delivery.id)
                sub.ack(delivery)
            stats = group_stats(b, subject, "c")
            return stats if stats and (stats["acked"], stats["in_flight"], stats["backlog"]) == (40, 0, 0) else None

        wait_for(settled, "the new master to hold every message acknowledged", timeout=30)
    assert again == []


def pull_exactly(sub, n: int) -> list:
    got: list = []
    while len(got) < n:
        got += sub.pull(max=n - len(got), wait_s=1.0)
    return got


def test_pulls_the_new_master_never_got_come_again_and_nothing_before_them(processes, tmp_path, meta) -> None:
    """Pulls do not wait for replicas: the master may be lost with its last pull entries (and acks)
    copied nowhere. The new master then answers the consumer's next pull `behind`, at the end of its
    own pull log; the consumer keeps what lies below (the same there) and acknowledges it again, and
    only the messages of the pulls the new master never got come again."""
    a, b = start_group(processes, tmp_path, meta)
    subject = "repl.behind"
    with Client(meta=meta) as client, client.subscribe(subject, "c", start="earliest") as sub:
        assert all(r.ok for r in client.send([OutgoingMessage(subject, f"m{i}") for i in range(60)]))
        copied = pull_exactly(sub, 20)
        for delivery in copied[:10]:
            sub.ack(delivery)
        sub.flush()
        end = replication(a)["log_end"]
        wait_for(lambda: (replication(b) or {}).get("durable", 0) >= end, "the replica to hold the first pulls")
        os.killpg(b.proc.pid, signal.SIGSTOP)  # for less than --max-lag: the meta server still counts it in sync
        try:
            # The next pull's entry still reaches the frozen replica (the answer to the fetch it was
            # waiting on, in its socket's buffer); the one after it, nothing.
            handed = pull_exactly(sub, 20)
            lost = pull_exactly(sub, 20)
            for delivery in copied[10:] + handed + lost:
                sub.ack(delivery)
            sub.flush()  # the old master has every ack; the replica has those of m0..m9 only
            processes.kill(a.proc, signal.SIGKILL)
        finally:
            os.killpg(b.proc.pid, signal.SIGCONT)
        wait_role(b, "master", epoch=2)
        again: list[str] = []

        def settled():
            for delivery in sub.pull(max=64, wait_s=0.2):
                again.append(delivery.id)
                sub.ack(delivery)
            stats = group_stats(b, subject, "c")
            return stats if stats and (stats["in_flight"], stats["backlog"]) == (0, 0) and again else None

        wait_for(settled, "the new master to hand out again what it never saw pulled", timeout=30)
    assert sorted(again) == sorted(d.id for d in lost)  # and none of what it had seen pulled


def test_a_nack_is_answered_only_once_the_replica_holds_its_retry(processes, tmp_path, meta) -> None:
    """A nack's answer promises the retry: the consumer then counts the message done, and its acks,
    sent again to a new master after a failover, cover it. So the master answers only once a replica
    holds the retry, as it does a send. Answered before, the retry was lost with the master, and the
    new master took the acks covering the message: it was never delivered again."""
    a, b = start_group(processes, tmp_path, meta)
    subject = "repl.nack"
    with Client(meta=meta) as client, client.subscribe(subject, "c", start="earliest") as sub:
        assert all(r.ok for r in client.send([OutgoingMessage(subject, f"m{i}") for i in range(20)]))
        pulled = pull_exactly(sub, 20)
        end = replication(a)["log_end"]
        wait_for(lambda: (replication(b) or {}).get("durable", 0) >= end, "the replica to hold the pulls")
        failing = pulled[-1]
        nacked: list[object] = []
        os.killpg(b.proc.pid, signal.SIGSTOP)  # for less than --max-lag: the meta server still counts it in sync
        try:
            # The acks' entry still reaches the frozen replica (the answer to the fetch it was waiting
            # on, in its socket's buffer); the nack's retry, nothing.
            for delivery in pulled[:-1]:
                sub.ack(delivery)
            sub.flush()
            nacking = threading.Thread(target=lambda: nacked.append(sub.nack(failing, delay_s=0.2)))
            nacking.start()
            wait_for(lambda: (group_stats(a, subject, "c") or {}).get("retrying") == 1, "the master to take the nack")
            processes.kill(a.proc, signal.SIGKILL)
        finally:
            os.killpg(b.proc.pid, signal.SIGCONT)
        nacking.join(timeout=30)
        wait_role(b, "master", epoch=2)
        again: list[str] = []

        def delivered_again() -> bool:
            for delivery in sub.pull(max=64, wait_s=0.2):
                again.append(delivery.id)
                sub.ack(delivery)
            return failing.id in again

        wait_for(delivered_again, "the new master to deliver the nacked message again", timeout=30)
    assert nacked == [None], nacked  # not answered: no replica held its retry


def test_a_nack_is_answered_while_the_group_is_read_only(processes, tmp_path, meta) -> None:
    """With no replica in sync the group takes no sends, but its consumers go on: a nack is answered
    with its retry held by the master alone (no replica can take over meanwhile, and the one that
    catches up copies it), rather than refused, which would deliver the message again and again."""
    a, b = start_group(processes, tmp_path, meta)
    subject = "repl.nack.read_only"
    with Client(meta=meta) as client, client.subscribe(subject, "c", start="earliest") as sub:
        assert all(r.ok for r in client.send([OutgoingMessage(subject, "m")]))
        (delivery,) = pull_exactly(sub, 1)
        processes.kill(b.proc, signal.SIGKILL)
        wait_for(lambda: (replication(a) or {}).get("writable") is False, "the master to turn read-only")
        outcome = sub.nack(delivery, delay_s=0.1)
        assert outcome is not None and outcome[0] == "retry", outcome
        retried = wait_for(lambda: sub.pull(max=1, wait_s=0.5), "the retry")
    assert [(d.id, d.attempt) for d in retried] == [(delivery.id, 2)]


def test_a_frozen_master_that_wakes_deposed_refuses_the_nack_it_finds(processes, tmp_path, meta) -> None:
    """A master frozen while the meta server promoted its replica wakes fenced, not knowing yet: its
    replica no longer follows it, so no replica is in sync, but its disk alone is not enough now (the
    new master would never have the retry, and the consumer's acks there would cover the message)."""
    a, b = start_group(processes, tmp_path, meta)
    subject = "repl.nack.deposed"
    with Client(meta=meta) as client:
        assert all(r.ok for r in client.send([OutgoingMessage(subject, "m")]))
    with a.connect() as conn:
        consumer = RawConsumer(conn, subject, "c", "raw", options={"start": "earliest"})
        (delivered,) = wait_for(lambda: consumer.pull(wait_ms=500), "the message")
        end = replication(a)["log_end"]
        wait_for(lambda: (replication(b) or {}).get("durable", 0) >= end, "the replica to hold the pull")
        os.killpg(a.proc.pid, signal.SIGSTOP)
        answers: list[object] = []

        def nack() -> None:
            try:
                answers.append(consumer.nack(delivered, 100))
            except RemoteError as exc:
                answers.append(exc.code)

        nacking = threading.Thread(target=nack)
        try:
            wait_role(b, "master", epoch=2)
            nacking.start()  # waits in the frozen master's socket: the first thing it reads on waking
        finally:
            os.killpg(a.proc.pid, signal.SIGCONT)
        nacking.join(timeout=30)
    assert answers and answers[0] in (ErrorCode.READ_ONLY, ErrorCode.NOT_MASTER), answers


def test_a_workers_backlog_probe_asks_the_new_master_soon_after_a_failover(processes, tmp_path, meta) -> None:
    """The worker's liveness asks the brokers of its route for the backlog. After a failover it asks
    the meta server for the route again rather than the lost master's address until the route
    expires (30 s), when its backlog figure would be unknown."""
    a, b = start_group(processes, tmp_path, meta)
    subject, wanted = "repl.backlog", {("repl.backlog", "w")}
    with Client(meta=meta) as client:
        client.subscribe(subject, "w").close()  # the group exists on the brokers, at the end
        assert all(r.ok for r in client.send([OutgoingMessage(subject, f"m{i}") for i in range(7)]))
        probe = BacklogProbe(client, None)
        try:
            assert probe.backlog(wanted) == 7
            wait_for(lambda: (replication(b) or {}).get("durable", 0) >= replication(a)["log_end"], "b to hold all")
            processes.kill(a.proc, signal.SIGKILL)
            wait_role(b, "master", epoch=2)
            assert probe.backlog(wanted) is None  # the address it knew is gone...
            wait_for(lambda: probe.backlog(wanted) == 7, "the probe to ask the new master", timeout=10)
        finally:
            probe.close()


def log_bytes(data_dir) -> bytes:
    return b"".join(p.read_bytes() for p in sorted((data_dir / "messagelog").iterdir()))


def test_a_frozen_master_is_deposed_acknowledges_nothing_more_and_rejoins_as_replica(processes, tmp_path, meta) -> None:
    a, b = start_group(processes, tmp_path, meta)
    producer = Producer(meta, 2_000)
    producer.start()
    wait_for(lambda: len(producer.acked) >= 300, "300 acknowledged")
    with a.connect() as to_a:
        os.killpg(a.proc.pid, signal.SIGSTOP)
        wait_role(b, "master", epoch=2)
        os.killpg(a.proc.pid, signal.SIGCONT)
        with pytest.raises(RemoteError) as refused:  # its first request after waking up
            send(to_a, SUBJECT, ["after-wake"])
        assert refused.value.code in (ErrorCode.READ_ONLY, ErrorCode.NOT_MASTER, ErrorCode.UNAVAILABLE)
    wait_role(a, "replica", epoch=2)
    producer.join(timeout=120)
    assert producer.error is None and len(set(producer.acked)) == 2_000
    wait_in_sync(b, a)
    assert set(consume(meta, set(producer.acked))) >= set(producer.acked)
    wait_for(lambda: (replication(a) or {}).get("log_end") == (replication(b) or {}).get("log_end"), "a caught up")
    for broker in (a, b):
        processes.kill(broker.proc, signal.SIGTERM)
    for broker in (a, b):
        assert_log_verifies(broker.data_dir)
    log_a, log_b = log_bytes(a.data_dir), log_bytes(b.data_dir)
    shared = min(len(log_a), len(log_b))
    assert shared > 0 and log_a[:shared] == log_b[:shared]


def test_two_meta_servers_the_deciding_one_killed_during_a_failover_the_other_finishes_it(
    processes, tmp_path, pg_url
) -> None:
    with fresh_database(pg_url) as url:
        metas = [start_meta(processes, url, name=f"meta{i}") for i in (1, 2)]
        meta = ",".join(f"{HOST}:{port}" for _, port in metas)  # every server and client gets both
        a, b = start_group(processes, tmp_path, meta)
        engine = sa.create_engine(url.replace("postgresql://", "postgresql+psycopg://"))
        try:

            def holder_pid() -> int | None:
                with engine.connect() as conn:
                    holder = conn.execute(sa.text("SELECT holder FROM qmq_meta_lease WHERE name = 'failover'")).scalar()
                return int(holder.split(":")[1]) if holder else None

            decider_pid = wait_for(holder_pid, "a meta server to hold the failover lease")
            decider = next(proc for proc, _ in metas if proc.pid == decider_pid)
            processes.kill(a.proc, signal.SIGKILL)
            processes.kill(decider, signal.SIGKILL)  # before it could decide (failover after 3 s)
            promoted = wait_role(b, "master", epoch=2)
            assert promoted["master"] == b.address
            assert holder_pid() != decider_pid
        finally:
            engine.dispose()
        a = restart_broker(processes, a, name="a-back")  # its disk survived: it rejoins as replica
        wait_role(a, "replica", epoch=2)
        wait_in_sync(b, a)
        with Client(meta=meta) as client:
            assert all(r.ok for r in client.send([OutgoingMessage(SUBJECT, f"after-{i}") for i in range(20)]))


HUNG_PHASE_S = 6.0  # sending while one meta server hangs: longer than the 4 s a master keeps writing


def test_a_hung_meta_server_is_left_for_the_other_before_the_master_fences_itself(processes, tmp_path, pg_url) -> None:
    """A meta server that hangs (its connections stay open, nothing answers) must not cost a group its
    writes while another meta server answers: the master fences itself `failover_after / 2` after its
    last answer, so it has to give up on the hung one and reach the other before that. With
    --failover-after 8 that is 4 s, heartbeats every 2 s: the hung one is given 1 s (with the tests'
    3 s, 0.375 s, which a loaded CI machine once missed)."""
    with fresh_database(pg_url) as url:
        metas = [start_meta(processes, url, "--failover-after", "8", name=f"meta{i}") for i in (1, 2)]
        meta = ",".join(f"{HOST}:{port}" for _, port in metas)
        a, b = start_group(processes, tmp_path, meta)  # both heartbeat to meta1, named first
        sent = 0
        with a.connect() as conn, contextlib.ExitStack() as resume:
            for proc, _ in metas:  # a stopped process would not end at the teardown's SIGTERM
                resume.callback(os.kill, proc.pid, signal.SIGCONT)
            # meta1 hangs: a and b move to meta2; then meta2 hangs and meta1 is back: they move back
            # (the next in the list after the one that failed, not the list's second again).
            for hung, back in ((metas[0][0], None), (metas[1][0], metas[0][0])):
                os.kill(hung.pid, signal.SIGSTOP)
                if back is not None:
                    os.kill(back.pid, signal.SIGCONT)
                until = time.monotonic() + HUNG_PHASE_S
                while time.monotonic() < until:  # each send waits for b's copy: refused once a is fenced
                    send(conn, SUBJECT, [f"while-hung-{sent}"])
                    sent += 1
        assert replication(a)["role"] == "master" and replication(b)["role"] == "replica"  # no failover either
    assert sent > 0
    log = a.proc.log_path.read_text()
    assert "fenced" not in log
    # it registered once, then said where its heartbeats went after each hang
    assert log.count("registered with meta server") == 1, log
    assert log.count("heartbeating to meta server") >= 2, log


def test_admin_failover_switches_the_master_by_hand_while_a_producer_runs(processes, tmp_path, meta) -> None:
    a, b = start_group(processes, tmp_path, meta)
    producer = Producer(meta, 1_500)
    producer.start()
    wait_for(lambda: len(producer.acked) >= 200, "200 acknowledged")
    admin_failover(meta, "g1", a, b)
    producer.join(timeout=120)
    assert producer.error is None and len(set(producer.acked)) == 1_500
    assert set(consume(meta, set(producer.acked))) >= set(producer.acked)


def test_master_back_on_a_wiped_disk_before_the_failover_is_not_master_again(processes, tmp_path, meta) -> None:
    a, b = start_group(processes, tmp_path, meta)
    with a.connect() as conn:
        for first in range(0, 1000, BATCH):
            reply = send(conn, SUBJECT, [f"w-{i:05d}" for i in range(first, first + BATCH)])
            assert reply["stored"] == BATCH, reply
    wait_for(lambda: replication(b)["log_end"] == replication(a)["log_end"], "the replica to hold the whole log")
    meta_in_sync(meta, "g1", b)
    processes.kill(a.proc, signal.SIGKILL)
    shutil.rmtree(a.data_dir)
    a = restart_broker(processes, a, name="a-wiped")  # back at once: well within --failover-after

    promoted = wait_role(b, "master", epoch=2)
    wait_role(a, "replica", epoch=2)
    wait_in_sync(b, a)
    assert promoted["log_end"] == replication(a)["log_end"] > 0
    consumed = consume(meta, {f"w-{i:05d}" for i in range(1000)})
    assert {f"w-{i:05d}" for i in range(1000)} <= set(consumed)


def test_a_caught_up_replica_fsyncs_each_chunk_on_its_own_loop_and_its_metrics_say_so(
    processes, tmp_path, meta
) -> None:
    """Each acknowledged send waited for the replica's fsync of its chunk, which a caught-up replica runs
    on its event loop (`Flusher.sync_now`), not through its flusher thread: `thread="caller"`."""
    metrics_port = free_port()
    a = start_member(processes, tmp_path / "a", meta, "g1", name="a")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, "g1", "--metrics-port", str(metrics_port), name="b")
    wait_role(b, "replica")
    wait_for_port(metrics_port, b.proc)
    wait_in_sync(a, b)
    meta_in_sync(meta, "g1", b)
    before = sample(scrape(metrics_port), "qmq_broker_fsyncs_total", thread="caller")
    with Client(meta=meta) as client:
        for i in range(50):  # one at a time: each is acknowledged once the replica has it durable
            assert client.send([OutgoingMessage(SUBJECT, f"m{i}")])[0].ok
    text = scrape(metrics_port)
    assert before is not None and sample(text, "qmq_broker_fsyncs_total", thread="caller") > before
    total = sum(sample(text, "qmq_broker_fsyncs_total", thread=t) for t in ("caller", "flusher"))
    assert sample(text, "qmq_broker_fsync_seconds_count") >= total


def test_a_killed_master_is_replaced_sooner_once_its_replica_lost_its_connection(processes, tmp_path, pg_url) -> None:
    """SIGKILL closes the master's sockets at once: the replica says `master_lost` in its heartbeats,
    and the meta server promotes it one heartbeat interval before --failover-after (8 s here, so 6 s:
    two seconds for the replica's word to arrive first)."""
    with fresh_database(pg_url) as url:
        meta_proc, meta_port = start_meta(processes, url, "--failover-after", "8")
        meta = f"{HOST}:{meta_port}"
        a, b = start_group(processes, tmp_path, meta)
        processes.kill(a.proc, signal.SIGKILL)
        wait_role(b, "master", timeout=30, epoch=2)
        assert "every in-sync replica lost its connection" in meta_proc.log_path.read_text(errors="replace")
