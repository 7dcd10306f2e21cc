"""Consumer positions outlive the message log's retention in a replicated broker group
(docs/replication.md: "Consumption state on broker replicas", "A new or wiped broker replica"),
with real processes, real sockets and a real SIGKILL.

The members' logs roll every 1 MiB and are kept 3.6 s (`--log-retention 0.001`), so a group's
journal entries (its creation, pulls and acks) expire within seconds of the group going idle:

- a replica keeps the consumption state as it copies the journal, and snapshots it: promoted after
  the master's loss, it serves an idle group from its position (before, it recovered from the
  journal alone and a group whose entries expired started again at the latest message, skipping
  what came meanwhile);
- a new replica joining once the master's first segment expired copies the master's state and
  fetches the retained log (before, it was refused for ever and the group took no sends).
"""

from __future__ import annotations

import shutil
import signal

from qmq.protocol.codes import RequestCode
from qmq.store.segment import list_segments
from tests.support.broker import Broker, RawConsumer, send, start_broker
from tests.support.replication import (
    MAX_LAG,
    meta_in_sync,
    meta_request,
    replication,
    wait_for,
    wait_in_sync,
    wait_role,
)

LOG_RETENTION_H = "0.001"  # 3.6 s
SEGMENT_MIB = "1"
SEGMENT_BYTES = 1024 * 1024
FILLER = b"f" * 10_000  # other subjects' traffic that rolls segments
SUBJECT = "bstate.orders"
OLD_SUBJECT = "bstate.old"  # every record of it expires: its sequences must go on where they were
NOISE = "bstate.noise"


def start_member(processes, data_dir, meta: str, name: str, *extra: str) -> Broker:
    return start_broker(
        processes,
        data_dir,
        "--meta",
        meta,
        "--group",
        "g1",
        "--max-lag",
        MAX_LAG,
        "--segment-mib",
        SEGMENT_MIB,
        "--log-retention",
        LOG_RETENTION_H,
        "--consumer-timeout",
        "600",  # nobody is released while the test waits for retention
        *extra,
        name=name,
    )


def segments(broker: Broker) -> list[int]:
    return [base for base, _ in list_segments(broker.data_dir / "messagelog")]


def send_all(broker: Broker, subject: str, ids: list[str], payload: bytes = b"m") -> None:
    with broker.connect() as conn:
        for start in range(0, len(ids), 50):
            reply = send(conn, subject, ids[start : start + 50], payload=payload)
            assert reply["stored"] == len(ids[start : start + 50]) and not reply["rejected"], reply


def roll_segment(broker: Broker, tag: str) -> None:
    """Append filler until the master's newest segment is a new one."""
    before = segments(broker)[-1]
    n = 0
    while segments(broker)[-1] == before:
        send_all(broker, NOISE, [f"{tag}-{n + i}" for i in range(20)], FILLER)
        n += 20


def expire(members: list[Broker], base: int, tag: str) -> None:
    """Roll past the segment `base` and wait until retention deleted it on every member, with other
    groups' traffic meanwhile; then leave the newest segment with room, so what follows stays."""
    master = members[0]
    roll_segment(master, tag)
    noise = RawConsumer(master.connect(), NOISE, "noise-group", "noise-1", {"start": "earliest"})

    def deleted() -> bool:
        noise.drain(10**6, empty_pulls=1, wait_ms=0)  # another group's pulls and acks meanwhile
        return all(base not in segments(m) for m in members)

    wait_for(deleted, f"retention to delete segment {base}", 60)
    noise.conn.close()
    stats = replication(master)
    if stats["log_end"] - segments(master)[-1] > SEGMENT_BYTES // 2:
        roll_segment(master, tag + "-room")


def dead_ids(broker: Broker, subject: str, group: str) -> list[str]:
    with broker.connect() as conn:
        reply = conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": subject, "group": group, "max": 100})
    return [m["id"] for m in reply["messages"]]


def lose_master(processes, master: Broker, replica: Broker) -> None:
    processes.kill(master.proc, signal.SIGKILL)
    shutil.rmtree(master.data_dir)  # the machine is lost, disk and all
    wait_role(replica, "master", timeout=30)


def moved_to(consumer: RawConsumer, broker: Broker) -> RawConsumer:
    """The same consumer (id and what it received) on a connection to `broker`."""
    consumer.conn.close()
    return RawConsumer(
        broker.connect(), consumer.subject, consumer.group, consumer.consumer, consumer.options, consumer.pulled
    )


def holds_log_of(replica: Broker, master: Broker) -> bool:
    mine, theirs = replication(replica), replication(master)
    return bool(mine and theirs and mine["role"] == "replica" and mine["log_end"] == theirs["log_end"])


def test_a_promoted_replica_serves_a_group_idle_past_the_retention_from_its_position(processes, tmp_path, meta):
    a = start_member(processes, tmp_path / "a", meta, "a", "--ack-replicas", "1")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, "b", "--ack-replicas", "1")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    meta_in_sync(meta, "g1", b)

    x = RawConsumer(a.connect(), SUBJECT, "x", "x-1")  # both start at the latest message
    idle = RawConsumer(a.connect(), SUBJECT, "idle", "idle-1")
    assert x.pull(wait_ms=0) == [] and idle.pull(wait_ms=0) == []
    first = [f"first-{i}" for i in range(100)]
    send_all(a, SUBJECT, first)
    for consumer in (x, idle):  # each acks half the messages
        assert [d.id for d in consumer.drain(50, max_count=50)] == first[:50]
    idle_at = segments(a)[-1]  # the groups' creation, pulls and acks are in this segment or before

    expire([a, b], idle_at, "push")  # on both members
    later = [f"later-{i}" for i in range(30)]
    send_all(a, SUBJECT, later)  # while the groups are idle
    (failing,) = x.pull(1)  # X's handler gives up on one message: a dead letter
    assert failing.id == later[0] and x.nack(failing, 0, dead=True)[0] == "dead"
    x.ack([failing])
    wait_for(lambda: holds_log_of(b, a), "b to hold a's log")
    wait_for(lambda: (b.data_dir / "consumers" / "consumers.snapshot").exists(), "the replica's own snapshot")

    lose_master(processes, a, b)
    x, idle = moved_to(x, b), moved_to(idle, b)
    assert [d.id for d in idle.drain(100)] == later, "the idle group did not resume exactly at its position"
    assert [d.id for d in x.drain(100)] == later[1:]
    assert dead_ids(b, SUBJECT, "x") == [later[0]]
    x.conn.close()
    idle.conn.close()


def test_a_new_replica_joining_after_retention_copies_the_state_and_serves_every_group(processes, tmp_path, meta):
    a = start_member(processes, tmp_path / "a", meta, "a")  # default --ack-replicas: 0 alone
    wait_role(a, "master")
    early = [f"early-{i}" for i in range(40)]
    behind = RawConsumer(a.connect(), SUBJECT, "behind", "behind-1", {"start": "earliest"})
    done = RawConsumer(a.connect(), SUBJECT, "done", "done-1", {"start": "earliest"})
    idle = RawConsumer(a.connect(), SUBJECT, "idle", "idle-1", {"start": "earliest"})
    old = RawConsumer(a.connect(), OLD_SUBJECT, "old", "old-1", {"start": "earliest"})
    send_all(a, SUBJECT, early)
    send_all(a, OLD_SUBJECT, [f"old-{i}" for i in range(25)])
    for consumer, count in ((behind, 40), (done, 40), (idle, 40), (old, 25)):
        assert len(consumer.drain(count)) == count
    expire([a], 0, "push")  # the master's log no longer starts at 0; idle's and old's entries are gone

    retained = [f"retained-{i}" for i in range(60)]
    send_all(a, SUBJECT, retained)
    assert [d.id for d in behind.drain(20, max_count=20)] == retained[:20]
    assert [d.id for d in done.drain(60)] == retained

    b = start_member(processes, tmp_path / "b", meta, "b")  # a new, empty replica
    wait_for(lambda: holds_log_of(b, a), "b to copy a's state and hold its log")
    wait_in_sync(a, b)
    meta_in_sync(meta, "g1", b)
    assert segments(b)[0] > 0  # its log begins at the master's log start, not at 0
    after = [f"after-{i}" for i in range(30)]
    send_all(a, SUBJECT, after)  # acknowledged by the master and b (--ack-replicas is 1 now)

    lose_master(processes, a, b)
    behind, done, idle, old = (moved_to(c, b) for c in (behind, done, idle, old))
    assert [d.id for d in behind.drain(200)] == retained[20:] + after
    assert [d.id for d in done.drain(200)] == after
    assert [d.id for d in idle.drain(200)] == retained + after
    assert old.drain(10, empty_pulls=1) == []
    forgot = meta_request(meta, RequestCode.REPL_FORGET, {"group": "g1", "address": a.address, "force": True})
    assert forgot["forgotten"]  # a is lost for good: b takes sends alone
    wait_for(lambda: (replication(b) or {}).get("writable") is True, "b to take sends alone")
    send_all(b, OLD_SUBJECT, ["old-new-0", "old-new-1"])  # its sequences go on where a's were
    assert [d.id for d in old.drain(2)] == ["old-new-0", "old-new-1"]
    for consumer in (behind, done, idle, old):
        consumer.conn.close()
