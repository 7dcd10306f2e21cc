"""A deposed master rejoins its group without wiping its data directory, although retention removed its
log's start and its newest consumption snapshot covers journal records that the new master never had
(docs/replication.md: "Consumption state on broker replicas"), with real processes, real sockets,
SIGSTOP/SIGCONT and a SIGKILL.

Before the broker kept its last few snapshots (qmq/broker/snapshot.py), such a master dropped its one
snapshot at the cut, could not replay the journal from the start of a log retention had cut short,
and so wiped its directory, copied the new master's state and fetched its whole retained log again
(up to 72 h of log in production). It now goes on from the snapshot before, replaying the journal
after it, and ends with the new master's consumer groups. And when the deposed master went on
journalling for longer than its last few snapshots span (a long split, consumers still using it), it
goes on from the one it set aside at what its replica held (`consumers.snapshot.replicated`).

The members' logs roll every 1 MiB and are kept 3.6 s (`--log-retention 0.001`, so a snapshot every
0.36 s while the journal moves); the meta server fails over after 2 s.
"""

from __future__ import annotations

import os
import signal

from qmq.broker import snapshot
from qmq.broker.service import STATE_DIR
from tests.support.broker import Broker, RawConsumer
from tests.support.replication import meta_in_sync, replication, wait_for, wait_in_sync, wait_role
from tests.test_broker_copy_corners import groups, lose, start_member, verify_store
from tests.test_broker_replica_state import SUBJECT, expire, holds_log_of, moved_to, segments, send_all

LAG = "30s"  # b stays in sync (so promotable) while it is frozen


def snapshots(broker: Broker) -> list[snapshot.Generation]:
    """The broker's kept consumption snapshots, newest first (read beside the live process)."""
    return snapshot.generations(broker.data_dir / STATE_DIR)[0]


def saved_up_to_its_log_end(broker: Broker) -> bool:
    """The broker's newest snapshot covers its whole journal (so nothing more is saved until the
    journal moves: no snapshot after SIGCONT shifts the older ones out)."""
    found, stats = snapshots(broker), replication(broker)
    return bool(found and stats and found[0].log_end == stats["log_end"])


def text(broker: Broker) -> str:
    return broker.proc.log_path.read_text(errors="replace")


def replica_holds_durably(master: Broker) -> bool:
    """Every replica told `master` it holds its whole log durable."""
    stats = replication(master)
    return bool(stats and stats["replicas"] and all(r["offset"] == stats["log_end"] for r in stats["replicas"]))


def diverging_group(processes, tmp_path, meta, *others: str) -> tuple[Broker, Broker, RawConsumer, list[str], list]:
    """Master a and replica b (and replicas named `others`) in sync, retention past every log's
    start, consumer x half-way through `retained`, and a snapshot on a (and on the others) of
    exactly the log b holds durable, with no journal after it. Returns a, b, x, retained, others."""
    options = ("--max-lag", LAG, "--ack-replicas", "1")
    a = start_member(processes, tmp_path / "a", meta, "a", *options)
    wait_role(a, "master")
    replicas = [start_member(processes, tmp_path / name, meta, name, *options) for name in ("b", *others)]
    for replica in replicas:
        wait_role(replica, "replica")
        wait_in_sync(a, replica)
        meta_in_sync(meta, "g1", replica)
    b, others_started = replicas[0], replicas[1:]

    x = RawConsumer(a.connect(), SUBJECT, "x", "x-1", {"start": "earliest"})
    send_all(a, SUBJECT, [f"old-{i}" for i in range(20)])
    assert len(x.drain(20)) == 20
    expire([a, *replicas], 0, "push")  # retention removed every log's start: a lost snapshot would mean a wipe
    retained = [f"retained-{i}" for i in range(100)]
    send_all(a, SUBJECT, retained)
    assert [d.id for d in x.drain(10, max_count=10)] == retained[:10]  # progress every member holds
    wait_for(
        lambda: (
            all(holds_log_of(r, a) for r in replicas)
            and replica_holds_durably(a)
            and all(saved_up_to_its_log_end(m) for m in (a, *others_started))
        ),
        "a's snapshot of the log b holds",
    )
    return a, b, x, retained, others_started


def promote_b(a: Broker, b: Broker, *with_a: Broker) -> int:
    """Freeze a and `with_a` (b, frozen until now, resumes), wait until the meta server made b
    master; they resume. Returns where a's log begins (retention removed what came before)."""
    frozen = []
    try:
        for member in (a, *with_a):
            os.killpg(member.proc.pid, signal.SIGSTOP)  # frozen: the meta server promotes b
            frozen.append(member)
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    try:
        wait_role(b, "master", timeout=30, epoch=2)
        log_start = segments(a)[0]
        assert log_start > 0
    finally:
        for member in frozen:
            os.killpg(member.proc.pid, signal.SIGCONT)
    return log_start


def rejoined_without_a_wipe(member: Broker, b: Broker, log_start: int) -> None:
    """`member` learns of b, cuts its log to b's and goes back to a kept snapshot instead of wiping
    its directory (and fetching its log again)."""
    wait_role(member, "replica", timeout=30, epoch=2)
    wait_for(lambda: holds_log_of(member, b), f"{member.address} to hold b's log")
    member_text = text(member)
    assert "going on from the one before it" in member_text, member_text
    assert "data directory is wiped" not in member_text and "installed a copy" not in member_text  # no re-copy
    assert "copies this master's consumption state" not in text(b)
    assert segments(member)[0] == log_start, "the log was fetched again"


def ends_with_the_new_masters_groups(processes, meta, b: Broker, member: Broker, x: RawConsumer, read: list[str]):
    """Promoted in turn (b lost), `member` has b's consumer groups, and x reads on from its position
    on b (after `read`)."""
    wait_in_sync(b, member)
    meta_in_sync(meta, "g1", member)
    after = [f"after-{i}" for i in range(20)]
    send_all(b, SUBJECT, after)  # acknowledged by b and a replica
    wait_for(lambda: holds_log_of(member, b), "the member to hold b's log")
    expected = groups(b)
    assert (SUBJECT, "x") in expected and (SUBJECT, "only-a") not in expected  # only-a was on a alone

    lose(processes, b, member, epoch=3)
    assert groups(member) == expected, "the deposed member's consumer groups are not the new master's"
    x = moved_to(x, member)
    ids = [d.id for d in x.drain(200)]
    assert ids[-len(after) :] == after and set(ids) <= set(read + after)  # from x's position on b
    x.conn.close()
    verify_store(processes, member)


def set_aside(broker: Broker) -> snapshot.Generation | None:
    return {g.path.name: g for g in snapshots(broker)}.get(snapshot.REPLICATED_NAME)


def test_a_deposed_master_goes_back_to_an_older_snapshot_and_rejoins_without_a_wipe(processes, tmp_path, meta):
    a, b, x, retained, _ = diverging_group(processes, tmp_path, meta)
    b_end = replication(a)["log_end"]
    os.kill(b.proc.pid, signal.SIGSTOP)
    # Journal records on a alone (but the first, which may go out in the reply to a fetch b had in
    # flight): x reads on, a group is created; then a snapshot of them, taken after the divergence.
    assert [d.id for d in x.drain(10, max_count=5)] == retained[10:20]
    only_a = RawConsumer(a.connect(), SUBJECT, "only-a", "only-a-1", {"start": "earliest"})
    assert len(only_a.drain(5, max_count=5)) == 5
    only_a.conn.close()

    def diverged() -> bool:
        found = snapshots(a)
        return saved_up_to_its_log_end(a) and any(g.log_end is not None and g.log_end <= b_end for g in found[1:])

    wait_for(diverged, "a's snapshot of its own journal, with one of b's log kept before it")
    assert replication(a)["log_end"] > b_end
    log_start = promote_b(a, b)
    rejoined_without_a_wipe(a, b, log_start)
    ends_with_the_new_masters_groups(processes, meta, b, a, x, retained[10:])


def journal_past(b_end: int, members: list[Broker], a: Broker, x: RawConsumer, retained: list[str]) -> None:
    """With b frozen at `b_end`: x's pull first (its journal record may still reach b), then a group
    on a alone, then x reads on, snapshot after snapshot on every member, until each of their slots
    holds one past b's log."""
    assert [d.id for d in x.drain(2, max_count=2)] == retained[10:12]
    only_a = RawConsumer(a.connect(), SUBJECT, "only-a", "only-a-1", {"start": "earliest"})
    assert len(only_a.drain(5, max_count=5)) == 5
    only_a.conn.close()
    read = 12

    def all_past(member: Broker) -> bool:
        return all(g.log_end is not None and g.log_end > b_end for g in snapshots(member)[: snapshot.KEPT_SNAPSHOTS])

    while not all(all_past(m) for m in members):
        seqs = [snapshots(m)[0].journal_seq for m in members]
        assert [d.id for d in x.drain(2, max_count=2)] == retained[read : read + 2]
        read += 2
        wait_for(
            lambda seqs=seqs: all(snapshots(m)[0].journal_seq > seq for m, seq in zip(members, seqs, strict=True)),
            "every member's next snapshot",
        )


def test_a_master_cut_off_longer_than_its_snapshots_span_goes_back_to_the_one_set_aside(processes, tmp_path, meta):
    a, b, x, retained, _ = diverging_group(processes, tmp_path, meta)
    b_end = replication(a)["log_end"]
    os.kill(b.proc.pid, signal.SIGSTOP)  # b holds what it held: what a failover keeps of a's log
    journal_past(b_end, [a], a, x, retained)
    assert set_aside(a) is not None and set_aside(a).log_end == b_end, snapshots(a)
    log_start = promote_b(a, b)
    rejoined_without_a_wipe(a, b, log_start)
    ends_with_the_new_masters_groups(processes, meta, b, a, x, retained[10:])


def test_a_replica_cut_off_with_its_master_goes_back_to_the_snapshot_set_aside_too(processes, tmp_path, meta):
    """A group of three split so that replica c stays with master a (consumers still using a) while b
    is promoted: c copied a's journal past b's log, so it is cut too. a told c, in its fetch replies,
    what every replica held (b's log end): c set aside its snapshot of that, as a did."""
    a, b, x, retained, (c,) = diverging_group(processes, tmp_path, meta, "c")
    b_end = replication(a)["log_end"]
    os.kill(b.proc.pid, signal.SIGSTOP)
    journal_past(b_end, [a, c], a, x, retained)
    assert set_aside(a) is not None and set_aside(a).log_end == b_end, snapshots(a)
    assert set_aside(c) is not None and set_aside(c).log_end <= b_end, snapshots(c)
    c_start = segments(c)[0]
    assert c_start > 0
    log_start = promote_b(a, b, c)
    rejoined_without_a_wipe(a, b, log_start)
    rejoined_without_a_wipe(c, b, c_start)
    processes.kill(a.proc, signal.SIGKILL)  # c is the one promoted next
    ends_with_the_new_masters_groups(processes, meta, b, c, x, retained[10:])
