"""A new or wiped replica of a delay-server group catches up whatever the age of the pending
messages (docs/replication.md: "A new or wiped delay-server replica"), with real processes, real
sockets and a real SIGKILL.

The master's message log rolls every 1 MiB and is kept 3.6 s (`--log-retention 0.001`), so its
oldest segments, holding messages still pending, are gone before the replica joins: the master
refuses its fetch from offset 0 and the replica copies the master's schedule instead, then the log
from there. Then the master is SIGKILLed and its directory deleted; the replica, promoted, fires
every pending message exactly once, on time, and neither what the master delivered nor what was
cancelled. Pending messages are due an hour ahead; once the replica is master the shared clock file
moves the delay servers' clock so they are due a few seconds later (docs/delay.md, "The clock for
tests").
"""

from __future__ import annotations

import shutil
import signal
import time

from delay_server.snapshot import PARTIAL_DIR
from delay_server.verify import iter_scheduled
from qmq.client import Client, OutgoingMessage
from qmq.replication.install import INSTALLING
from tests.support.broker import start_broker
from tests.support.delay import Arrivals, dispatched_ids, restart_delay_server
from tests.support.replication import (
    meta_in_sync,
    replication,
    start_delay_member,
    wait_for,
    wait_in_sync,
    wait_role,
)

SUBJECT = "delay.catchup.reminders"
LOG_RETENTION_H = "0.001"  # 3.6 s: segments sealed before the replica joins are deleted first
SEGMENT_MIB = "1"
PENDING = 600  # ~3 KB each: the first segments roll and expire while these are all pending
BODY = "x" * 3000
SOON = 30  # due at once: delivered by the master before the replica joins
CANCELLED = 40  # of the pending ones, cancelled before the replica joins
AHEAD_MS = 3_600_000  # pending messages are due an hour ahead...
DUE_AFTER_SHIFT_S = 3.0  # ...until the clock moves them to this long after the promotion
SLACK_S = 3.0  # lateness of a healthy delay server on a shared 2-core machine


def start_member(processes, data_dir, meta: str, clock_file, name: str, ack_replicas: str = "1"):
    return start_delay_member(
        processes,
        data_dir,
        meta,
        name,
        *("--segment-mib", SEGMENT_MIB, "--log-retention", LOG_RETENTION_H, "--clock-file", str(clock_file)),
        ack_replicas=ack_replicas,
    )


def send_all(client: Client, messages: list[OutgoingMessage]) -> None:
    """Send every message (a failed one again, same id) until each is acknowledged."""
    batch = messages
    while batch:
        failed = {r.message_id for r in client.send(batch) if not r.ok}
        batch = [m for m in batch if m.id in failed]


def first_segment_gone(server) -> bool:
    return not (server.data_dir / "messagelog" / ("0" * 20)).exists()


class Workload:
    """Messages delivered at once, messages pending (an hour ahead) and cancels among them; then
    the old segments expire on the master, so a replica can only get them from a copy."""

    def __init__(self, meta: str, master) -> None:
        self.consumer = Arrivals(Client(meta=meta), SUBJECT)
        now_ms = int(time.time() * 1000)
        self.soon = [OutgoingMessage(SUBJECT, {"n": i}, deliver_at=now_ms + 300) for i in range(SOON)]
        self.due_ms = now_ms + AHEAD_MS
        self.pending = [
            OutgoingMessage(SUBJECT, {"n": i, "body": BODY}, key=str(i), deliver_at=self.due_ms + i)
            for i in range(PENDING)
        ]
        with Client(meta=meta) as producer:
            send_all(producer, self.soon + self.pending)
            wait_for(lambda: master.stats()["fired"] >= SOON, "the master to deliver the first messages")
            assert master.stats()["fired"] == SOON, "the master delivered more than it was sent"
            self.cancelled = {m.id for m in self.pending[:CANCELLED]}
            outcomes = producer.cancel(list(self.cancelled))
            assert set(outcomes.values()) == {"cancelled"}
        wait_for(lambda: first_segment_gone(master), "retention to delete the master's oldest segments", 30)
        self.due = {m.id: m.deliver_at for m in self.pending if m.id not in self.cancelled}

    def check_fired_by(self, new_master, clock_file) -> None:
        """Shift the clock so the pending messages come due, and check each arrives once, on time,
        and nothing else (what the master delivered, what was cancelled) arrives again."""
        shift_s = (self.due_ms - int(time.time() * 1000)) / 1000 - DUE_AFTER_SHIFT_S
        clock_file.write_text(repr(shift_s))
        missing = self.consumer.wait_for(set(self.due), DUE_AFTER_SHIFT_S + 60)
        time.sleep(1.0)  # a second copy, or a cancelled message, would arrive within this
        self.consumer.close()
        assert not missing, f"{len(missing)} of {len(self.due)} pending messages never arrived"
        received = self.consumer.received
        assert not self.cancelled & received.keys(), "a cancelled message was delivered"
        assert all(len(received[m.id]) == 1 for m in self.soon), "a message the master delivered came again"
        twice = [i for i in self.due if len(received[i]) > 1]
        assert not twice, f"{len(twice)} messages arrived more than once"
        assert new_master.stats()["fired"] == len(self.due)  # it fired each once, and nothing else
        late_s = [(received[i][0] + shift_s * 1000 - due) / 1000 for i, due in self.due.items()]
        assert min(late_s) >= -0.005, f"a message came {-min(late_s):.3f} s early"
        assert max(late_s) <= SLACK_S, f"a message came {max(late_s):.2f} s late"


def check_copied(replica, master_dir_ids: set[str], workload: Workload) -> None:
    """The replica's buckets hold every message once, and its dispatch logs what the master delivered."""
    ids = [r.message_id for _, r in iter_scheduled(replica.data_dir)]
    assert len(ids) == len(set(ids)), "a message is filed twice"
    assert {m.id for m in workload.pending} <= set(ids)
    assert dispatched_ids(replica.data_dir) == master_dir_ids == {m.id for m in workload.soon}


def wait_caught_up(master, replica) -> None:
    """The replica, as it reports itself, holds the master's whole log; and the master counts it in
    sync. (The master alone could still count a killed replica in sync, for up to --max-lag.)"""

    def caught_up() -> bool:
        mine, theirs = replication(replica), replication(master)
        return bool(mine and theirs and mine["role"] == "replica" and mine["log_end"] == theirs["log_end"])

    wait_for(caught_up, f"{replica.address} to hold {master.address}'s log")
    wait_in_sync(master, replica)


def lose_master(processes, master, replica) -> None:
    processes.kill(master.proc, signal.SIGKILL)
    shutil.rmtree(master.data_dir)  # the machine is lost, disk and all
    wait_role(replica, "master", timeout=30)


def test_a_new_replica_joining_after_retention_copies_the_schedule_and_fires_everything_once(
    processes, tmp_path, meta
) -> None:
    start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "b1")
    clock_file = tmp_path / "clock"
    a = start_member(processes, tmp_path / "a", meta, clock_file, "a", ack_replicas="0")  # alone: takes sends
    wait_role(a, "master")
    workload = Workload(meta, a)

    b = start_member(processes, tmp_path / "b", meta, clock_file, "b")  # the master no longer has offset 0
    wait_caught_up(a, b)
    meta_in_sync(meta, "delay:d1", b)
    assert not (b.data_dir / "messagelog" / ("0" * 20)).exists()  # its log begins where the copy ends
    check_copied(b, dispatched_ids(a.data_dir), workload)

    lose_master(processes, a, b)
    workload.check_fired_by(b, clock_file)


def test_a_wiped_replica_rejoins_after_retention_survives_a_restart_and_fires_everything_once(
    processes, tmp_path, meta
) -> None:
    start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "b1")
    clock_file = tmp_path / "clock"
    a = start_member(processes, tmp_path / "a", meta, clock_file, "a")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, clock_file, "b")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "delay:d1", b)
    workload = Workload(meta, a)

    processes.kill(b.proc, signal.SIGKILL)
    shutil.rmtree(b.data_dir)  # a new disk
    b = restart_delay_server(processes, b, name="b-wiped")
    wait_caught_up(a, b)
    check_copied(b, dispatched_ids(a.data_dir), workload)
    assert not (b.data_dir / INSTALLING).exists() and not (b.data_dir / PARTIAL_DIR).exists()

    # Restarted, the replica goes on from its copy: nothing copied again, nothing filed twice.
    processes.kill(b.proc, signal.SIGKILL)
    b = restart_delay_server(processes, b, name="b-restarted")
    wait_caught_up(a, b)
    meta_in_sync(meta, "delay:d1", b)
    check_copied(b, {m.id for m in workload.soon}, workload)

    lose_master(processes, a, b)
    workload.check_fired_by(b, clock_file)
