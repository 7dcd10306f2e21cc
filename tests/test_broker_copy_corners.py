"""A broker replica that retention left behind copies the master's consumption state before the log
(docs/replication.md: "A new or wiped broker replica"); three corners of that, with real processes,
real sockets and real SIGKILLs. Each process dies exactly where the test wants it through a crash
point (`QMQ_TEST_CRASH_AT`, qmq/replication/crash_points.py): the process SIGKILLs itself there.

- killed mid-install (the log begun, the state not yet written, the install marker still there):
  restarted, the replica wipes the half copy, copies again and ends with the master's state;
- the master killed while a replica copies its state, in a group of three: the in-sync replica is
  promoted and the copying replica copies again from it;
- the master killed right after serving a copy covering journal records its in-sync replica does not
  have yet (that replica was frozen): the copying replica either holds nothing of the log past the
  copy's start (its state is then ahead of the new master's log) or holds more log than the new master
  (it is told to cut it, REPL_EPOCH_END); either way it must end with the new master's state, not the
  old master's, and no acknowledged message lost.

The members' logs roll every 1 MiB and are kept 3.6 s (`--log-retention 0.001`). Every state is
compared as the masters report it (BROKER_STATS, per group: backlog, acknowledged, in flight, dead,
consumers), and the last master's store passes `qmq log verify`.
"""

from __future__ import annotations

import os
import signal

import pytest

from qmq.replication.crash_points import CRASH_AT_ENV
from qmq.replication.install import INSTALLING
from qmq.store.segment import list_segments
from tests.support.broker import Broker, RawConsumer, restart_broker, start_broker
from tests.support.replication import meta_in_sync, replication, wait_for, wait_in_sync, wait_role
from tests.support.stores import assert_log_verifies
from tests.test_broker_replica_state import (
    LOG_RETENTION_H,
    NOISE,
    SEGMENT_MIB,
    SUBJECT,
    expire,
    holds_log_of,
    moved_to,
    segments,
    send_all,
)

OLD_SUBJECT = "bcorner.old"  # every record of it expires


def start_member(processes, data_dir, meta: str, name: str, *extra: str, crash_at: str | None = None) -> Broker:
    return start_broker(
        processes,
        data_dir,
        "--meta",
        meta,
        "--group",
        "g1",
        "--segment-mib",
        SEGMENT_MIB,
        "--log-retention",
        LOG_RETENTION_H,
        "--consumer-timeout",
        "600",  # nobody is released while the test waits
        *extra,
        name=name,
        env={CRASH_AT_ENV: crash_at} if crash_at else None,
    )


def groups(broker: Broker) -> dict[tuple[str, str], tuple]:
    """Each consumer group's state as the master reports it."""
    with broker.connect() as conn:
        reply = conn.request(broker.stats_code, {})
    keys = ("backlog", "acked", "in_flight", "retrying", "dead", "consumers")
    return {(g["subject"], g["group"]): tuple(g[k] for k in keys) for g in reply["groups"] if g["subject"] != NOISE}


def died_by_its_crash_point(broker: Broker) -> None:
    assert broker.proc.wait(timeout=60) == -signal.SIGKILL, "the server did not stop at its crash point"


def verify_store(processes, broker: Broker) -> None:
    processes.kill(broker.proc, signal.SIGTERM)
    assert_log_verifies(broker.data_dir)


class Consumers:
    """Groups in every situation a copy must carry: one idle past the retention (all its journal
    entries expired), one part way, one whose subject has no record left, one that read everything."""

    def __init__(self, master: Broker) -> None:
        self.idle = RawConsumer(master.connect(), SUBJECT, "idle", "idle-1", {"start": "earliest"})
        self.behind = RawConsumer(master.connect(), SUBJECT, "behind", "behind-1", {"start": "earliest"})
        self.done = RawConsumer(master.connect(), SUBJECT, "done", "done-1", {"start": "earliest"})
        self.old = RawConsumer(master.connect(), OLD_SUBJECT, "old", "old-1", {"start": "earliest"})
        self.early = [f"early-{i}" for i in range(40)]
        send_all(master, SUBJECT, self.early)
        send_all(master, OLD_SUBJECT, [f"old-{i}" for i in range(25)])
        for consumer, count in ((self.idle, 40), (self.behind, 40), (self.done, 40), (self.old, 25)):
            assert len(consumer.drain(count)) == count

    def after_retention(self, master: Broker) -> None:
        self.retained = [f"retained-{i}" for i in range(60)]
        send_all(master, SUBJECT, self.retained)
        assert [d.id for d in self.behind.drain(20, max_count=20)] == self.retained[:20]

    def all(self) -> list[RawConsumer]:
        return [self.idle, self.behind, self.done, self.old]

    def close(self) -> None:
        for consumer in self.all():
            consumer.conn.close()


def lose(processes, master: Broker, replica: Broker, epoch: int) -> None:
    processes.kill(master.proc, signal.SIGKILL)
    wait_role(replica, "master", timeout=30, epoch=epoch)


def test_a_replica_killed_mid_install_copies_again_and_ends_with_the_masters_state(processes, tmp_path, meta):
    a = start_member(processes, tmp_path / "a", meta, "a", "--max-lag", "1s")
    wait_role(a, "master")
    consumers = Consumers(a)
    expire([a], 0, "push")
    consumers.after_retention(a)
    assert [d.id for d in consumers.done.drain(60)] == consumers.retained

    c = start_member(processes, tmp_path / "c", meta, "c", "--max-lag", "1s", crash_at="snapshot-install")
    died_by_its_crash_point(c)
    assert (c.data_dir / INSTALLING).exists()  # killed mid-install: the log begun, the state not written
    assert list_segments(c.data_dir / "messagelog") and not (c.data_dir / "consumers" / "consumers.snapshot").exists()

    c = restart_broker(processes, c, name="c-restarted")  # without the crash point
    wait_for(lambda: holds_log_of(c, a), "c to copy a's state again and hold its log")
    wait_in_sync(a, c)
    meta_in_sync(meta, "g1", c)
    assert not (c.data_dir / INSTALLING).exists() and segments(c)[0] > 0
    expected = groups(a)

    lose(processes, a, c, epoch=2)
    assert groups(c) == expected
    idle, behind, done, old = (moved_to(x, c) for x in consumers.all())
    assert [d.id for d in idle.drain(200)] == consumers.retained
    assert [d.id for d in behind.drain(200)] == consumers.retained[20:]
    assert done.drain(10, empty_pulls=1) == [] and old.drain(10, empty_pulls=1) == []
    for consumer in (idle, behind, done, old):
        consumer.conn.close()
    verify_store(processes, c)


def test_the_master_killed_during_a_copy_the_replica_copies_again_from_the_new_master(processes, tmp_path, meta):
    a = start_member(processes, tmp_path / "a", meta, "a", "--max-lag", "1s", crash_at="snapshot-read")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, "b", "--max-lag", "1s")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "g1", b)
    consumers = Consumers(a)
    expire([a, b], 0, "push")  # on both: b's log no longer begins at 0 either
    consumers.after_retention(a)

    c = start_member(processes, tmp_path / "c", meta, "c", "--max-lag", "1s")  # a new, empty replica
    died_by_its_crash_point(a)  # a died serving c the first part of its copy
    wait_role(b, "master", timeout=30, epoch=2)
    wait_for(lambda: holds_log_of(c, b), "c to copy b's state and hold its log")
    wait_in_sync(b, c)
    meta_in_sync(meta, "g1", c)
    assert segments(c)[0] > 0
    moved = [moved_to(x, b) for x in consumers.all()]
    after = [f"after-{i}" for i in range(30)]
    send_all(b, SUBJECT, after)  # acknowledged by b and c
    assert [d.id for d in moved[2].drain(200)] == consumers.retained + after  # done: its copy counted
    wait_for(lambda: holds_log_of(c, b), "c to hold b's log")
    expected = groups(b)

    lose(processes, b, c, epoch=3)
    assert groups(c) == expected
    idle, behind, done, old = (moved_to(x, c) for x in moved)
    assert [d.id for d in idle.drain(200)] == consumers.retained + after
    assert [d.id for d in behind.drain(200)] == consumers.retained[20:] + after
    assert done.drain(10, empty_pulls=1) == [] and old.drain(10, empty_pulls=1) == []
    for consumer in (idle, behind, done, old):
        consumer.conn.close()
    verify_store(processes, c)


@pytest.mark.parametrize(
    "crash_at",
    [
        "fetch-after-install",  # the copier holds none of the log past the copy's start: its state is ahead
        "fetch-after-copy",  # the copier holds more log than the new master: it is told to cut it
    ],
)
def test_the_master_killed_right_after_a_copy_only_it_held_the_copier_ends_with_the_new_masters_state(
    processes, tmp_path, meta, crash_at
):
    lag = "30s"  # b stays in sync (so promotable) while it is frozen
    a = start_member(processes, tmp_path / "a", meta, "a", "--max-lag", lag, "--ack-replicas", "1", crash_at=crash_at)
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, "b", "--max-lag", lag, "--ack-replicas", "1")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "g1", b)
    consumers = Consumers(a)
    expire([a, b], 0, "push")
    consumers.after_retention(a)  # acknowledged: b has these
    wait_for(lambda: holds_log_of(b, a), "b to hold a's log")

    os.kill(b.proc.pid, signal.SIGSTOP)  # b falls behind, still in sync for a while
    try:
        # Journal records on a alone (but the first, which may go out in the reply to a fetch b had
        # in flight): done reads everything, a group is created; then c copies the state (covering
        # them) and a dies at c's first fetch, or once c holds the log past b's end.
        assert [d.id for d in consumers.done.drain(60)] == consumers.retained
        fresh = RawConsumer(a.connect(), SUBJECT, "fresh", "fresh-1", {"start": "earliest"})
        assert len(fresh.drain(5, max_count=5)) == 5
        fresh.conn.close()
        a_end = replication(a)["log_end"]
        c = start_member(processes, tmp_path / "c", meta, "c", "--max-lag", lag, "--ack-replicas", "1")
        died_by_its_crash_point(a)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    c_stats = replication(c)
    assert c_stats is not None and c_stats["log_end"] <= a_end
    if crash_at == "fetch-after-copy":
        assert c_stats["log_end"] == a_end  # more than b holds: c will be told to cut

    wait_role(b, "master", timeout=30, epoch=2)
    wait_for(lambda: holds_log_of(c, b), "c to hold b's log")
    wait_in_sync(b, c)
    meta_in_sync(meta, "g1", c)
    moved = [moved_to(x, b) for x in consumers.all()]
    after = [f"after-{i}" for i in range(30)]
    send_all(b, SUBJECT, after)  # acknowledged by b and c
    late = RawConsumer(b.connect(), SUBJECT, "late", "late-1")  # created on b, at the latest message
    assert late.drain(5, empty_pulls=1, wait_ms=0) == []
    late.conn.close()
    wait_for(lambda: holds_log_of(c, b), "c to hold b's log")
    expected = groups(b)
    assert (SUBJECT, "late") in expected and (SUBJECT, "fresh") not in expected  # fresh was on a alone

    lose(processes, b, c, epoch=3)
    assert groups(c) == expected, "the copier's consumer groups are not the new master's"
    idle, behind, done, old = (moved_to(x, c) for x in moved)
    assert [d.id for d in idle.drain(200)] == consumers.retained + after
    assert [d.id for d in behind.drain(200)] == consumers.retained[20:] + after
    # done read and acked the retained messages on a; b may have got the journal record of that read
    # (the reply to the fetch b had in flight when it froze) but not of the ack: then they are in flight
    done_ids = [d.id for d in done.drain(200)]
    assert done_ids[-len(after) :] == after and set(done_ids) <= set(consumers.retained + after)
    assert old.drain(10, empty_pulls=1) == []
    audit = RawConsumer(c.connect(), SUBJECT, "audit", "audit-1", {"start": "earliest"})
    assert {d.id for d in audit.drain(500)} >= set(consumers.retained + after)  # no acknowledged message lost
    for consumer in (idle, behind, done, old, audit):
        consumer.conn.close()
    verify_store(processes, c)
