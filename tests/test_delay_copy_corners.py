"""A delay-server replica that retention left behind copies the master's schedule before the log
(docs/replication.md: "A new or wiped delay-server replica"); the master is lost while the replica
copies it, in a group of three, with real processes, real sockets and real SIGKILLs. The master dies
at the first part of its schedule the replica reads (a crash point: `QMQ_TEST_CRASH_AT`,
qmq/replication/crash_points.py), the in-sync replica is promoted, and the copying replica copies
again from it: its schedule, dispatch logs and cancels end byte for byte the new master's, and
promoted in turn it fires every pending message once, on time, and nothing delivered or cancelled.
"""

from __future__ import annotations

import os
import signal
import time

from delay_server.schedule_log import CHECKPOINT_FILE
from delay_server.verify import iter_scheduled
from qmq.client import Client, OutgoingMessage
from qmq.replication.crash_points import CRASH_AT_ENV
from tests.support.broker import start_broker
from tests.support.delay import dispatched_ids
from tests.support.replication import meta_in_sync, start_delay_member, wait_for, wait_in_sync, wait_role
from tests.support.stores import assert_log_verifies
from tests.test_delay_replica_catch_up import (
    BODY,
    LOG_RETENTION_H,
    PENDING,
    SEGMENT_MIB,
    SOON,
    SUBJECT,
    Workload,
    check_copied,
    first_segment_gone,
    send_all,
    wait_caught_up,
)


def start_member(processes, data_dir, meta: str, clock_file, name: str, crash_at: str | None = None, extra=()):
    return start_delay_member(
        processes,
        data_dir,
        meta,
        name,
        *extra,
        *("--segment-mib", SEGMENT_MIB, "--log-retention", LOG_RETENTION_H, "--clock-file", str(clock_file)),
        env={CRASH_AT_ENV: crash_at} if crash_at else None,
    )


def delay_files(server) -> dict[str, bytes]:
    """The schedule, dispatch logs and cancels (not the schedule checkpoint, each server's own)."""
    return {
        str(path.relative_to(server.data_dir)): path.read_bytes()
        for part in ("schedule", "dispatch", "cancels")
        for path in sorted((server.data_dir / part).glob("*"))
        if path.is_file() and path.name != CHECKPOINT_FILE
    }


def test_the_master_killed_during_a_schedule_copy_the_replica_copies_again_from_the_new_master(
    processes, tmp_path, meta
) -> None:
    start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "b1")
    clock_file = tmp_path / "clock"
    a = start_member(processes, tmp_path / "a", meta, clock_file, "a", crash_at="snapshot-read")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, clock_file, "b")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "delay:d1", b)
    workload = Workload(meta, a)  # b's log expires too, as a's
    wait_for(lambda: first_segment_gone(b), "retention to delete b's oldest segments", 30)

    c = start_member(processes, tmp_path / "c", meta, clock_file, "c")  # a new, empty replica
    assert a.proc.wait(timeout=60) == -signal.SIGKILL, "a did not die serving c the first part of its copy"
    wait_role(b, "master", timeout=30, epoch=2)
    wait_caught_up(b, c)
    meta_in_sync(meta, "delay:d1", c)
    check_copied(c, dispatched_ids(b.data_dir), workload)
    assert delay_files(c) == delay_files(b)

    processes.kill(b.proc, signal.SIGKILL)
    wait_role(c, "master", timeout=30, epoch=3)
    workload.check_fired_by(c, clock_file)
    processes.kill(c.proc, signal.SIGTERM)
    assert_log_verifies(c.data_dir)


def test_the_master_killed_right_after_a_schedule_copy_only_it_held_the_copier_copies_the_new_masters(
    processes, tmp_path, meta
) -> None:
    """The copy covers dispatch notes only the old master had (its in-sync replica was frozen): the
    copier, told of the new master before it fetched that far, copies the new master's schedule
    again. Kept, the old copy would say the log is filed further than the new master's log went
    then, and the copier would skip filing what the new master stores there (a send it acknowledged)."""
    start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "b1")
    clock_file = tmp_path / "clock"
    lag = ("--max-lag", "30s")  # b stays in sync (so promotable) while it is frozen
    a = start_member(processes, tmp_path / "a", meta, clock_file, "a", crash_at="fetch-after-install", extra=lag)
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, clock_file, "b", extra=lag)
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "delay:d1", b)
    workload = Workload(meta, a)
    wait_for(lambda: first_segment_gone(b), "retention to delete b's oldest segments", 30)
    now_ms = int(time.time() * 1000)
    soon = [  # two deliveries, so at least one dispatch note is on a alone
        OutgoingMessage(SUBJECT, {"later": i}, deliver_at=now_ms + (1500 if i < 5 else 2500)) for i in range(10)
    ]
    with Client(meta=meta) as producer:
        send_all(producer, soon)
    wait_caught_up(a, b)

    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: a.stats()["fired"] == SOON + len(soon), "a to deliver the later messages")
        c = start_member(processes, tmp_path / "c", meta, clock_file, "c", extra=lag)
        assert a.proc.wait(timeout=60) == -signal.SIGKILL, "a did not die at c's first fetch"
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    wait_role(b, "master", timeout=30, epoch=2)
    wait_caught_up(b, c)
    meta_in_sync(meta, "delay:d1", c)
    post = [
        OutgoingMessage(SUBJECT, {"post": i, "body": BODY}, deliver_at=workload.due_ms + PENDING + i) for i in range(20)
    ]
    with Client(meta=meta) as producer:
        send_all(producer, post)  # stored by b where a's log went on: acknowledged by b and c
    workload.due.update({m.id: m.deliver_at for m in post})
    wait_caught_up(b, c)
    ids = [r.message_id for _, r in iter_scheduled(c.data_dir)]
    assert len(ids) == len(set(ids)) and set(workload.due) <= set(ids), "c's buckets miss messages"
    assert dispatched_ids(c.data_dir) == dispatched_ids(b.data_dir)
    assert delay_files(c) == delay_files(b)

    processes.kill(b.proc, signal.SIGKILL)
    wait_role(c, "master", timeout=30, epoch=3)
    workload.check_fired_by(c, clock_file)
