"""A damaged message-log record in a replicated group is mended from another member (issue 19;
docs/replication.md, "A damaged record"): real meta server and brokers, bytes flipped in their files.

- the master's copy damaged: the group's consumers get every message, the damaged one included,
  and the master's bytes are the replica's again;
- every copy damaged: after the give-up time the message becomes a dead letter naming the damage
  and the group moves on, as a broker alone does at once;
- the replica's copy damaged in an old segment: its background scrub finds it after a restart and it
  mends it from the master;
- a new replica catching up meets a record damaged on the master (and nowhere else): the master cuts
  it out (bytes to quarantine/, a blank record in their place, naming the message) and the replica
  catches up past it; after a failover the replica still dead-letters that message.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from qmq.protocol.codes import RequestCode
from qmq.store import record as rec
from qmq.store.damage import MEND_GIVE_UP_S
from tests.support.broker import RawConsumer, restart_broker, send, start_broker
from tests.support.replication import (
    meta_in_sync,
    replication,
    start_member,
    wait_for,
    wait_in_sync,
    wait_role,
)

SUBJECT = "mend.orders"
COUNT = 3000
PAYLOAD = b"m" * 1000  # 3,000 of them fill three 1 MiB segments
VICTIM = "m-00010"
CONSUME_TIMEOUT_S = 60.0


@pytest.fixture
def group(processes, tmp_path, meta):
    """A master and a replica of group g1 (1 MiB segments) holding COUNT acknowledged messages."""
    a = start_member(processes, tmp_path / "a", meta, "g1", "--segment-mib", "1", name="a")
    wait_role(a, "master")
    b = start_member(processes, tmp_path / "b", meta, "g1", "--segment-mib", "1", name="b")
    wait_role(b, "replica")
    wait_in_sync(a, b)
    fill(a)
    wait_for(lambda: replication(b)["log_end"] == replication(a)["log_end"], "the replica to hold the whole log")
    return a, b


def fill(broker) -> None:
    with broker.connect() as conn:
        for first in range(0, COUNT, 100):
            reply = send(conn, SUBJECT, [f"m-{i:05d}" for i in range(first, first + 100)], payload=PAYLOAD)
            assert reply["stored"] == 100, reply


def locate(data_dir: Path, message_id: str) -> tuple[Path, int, int]:
    """The segment file holding `message_id` and the record's position and size in it."""
    for path in sorted((data_dir / "messagelog").iterdir()):
        data = path.read_bytes()
        position = 0
        while position < len(data):
            record = rec.decode(data, position, int(path.name))
            if record.message_id == message_id:
                return path, position, record.size
            position += record.size
    raise AssertionError(f"{message_id} is in no segment of {data_dir}")


def flip_last_byte(path: Path, position: int, size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(position + size - 1)
        byte = f.read(1)
        f.seek(position + size - 1)
        f.write(bytes([byte[0] ^ 0xFF]))


def consume_all(broker, expected: int, group: str = "g") -> list[str]:
    """Every message id `group` gets from the start, acked as they come, once `expected` arrived or
    nothing more came for CONSUME_TIMEOUT_S."""
    ids: list[str] = []
    with broker.connect() as conn:
        consumer = RawConsumer(conn, SUBJECT, group, "c", {"start": "earliest"})
        deadline = time.monotonic() + CONSUME_TIMEOUT_S
        while len(ids) < expected and time.monotonic() < deadline:
            got = consumer.pull(max_count=500, wait_ms=1000)
            ids.extend(d.id for d in got)
            if got:
                consumer.ack(got)
    return ids


def dead_letters(broker, group: str = "g") -> list[dict]:
    with broker.connect() as conn:
        return conn.request(RequestCode.BROKER_DEAD_LIST, {"subject": SUBJECT, "group": group})["messages"]


def test_a_damaged_record_on_the_master_is_mended_from_the_replica(group) -> None:
    a, _b = group
    path, position, size = locate(a.data_dir, VICTIM)
    good = path.read_bytes()[position : position + size]
    flip_last_byte(path, position, size)

    ids = consume_all(a, COUNT)

    assert ids == [f"m-{i:05d}" for i in range(COUNT)]  # the damaged one too, in its place
    assert dead_letters(a) == []
    assert path.read_bytes()[position : position + size] == good
    damage = replication(a)["damage"]
    assert damage == {"awaiting": 0, "mended": 1, "lost": 0}, damage
    assert "mended" in a.proc.log_path.read_text()


def test_a_record_damaged_on_every_member_becomes_a_dead_letter(group) -> None:
    a, b = group
    for member in (a, b):
        path, position, size = locate(member.data_dir, VICTIM)
        flip_last_byte(path, position, size)

    started = time.monotonic()
    ids = consume_all(a, COUNT - 1)
    waited = time.monotonic() - started

    assert ids == [f"m-{i:05d}" for i in range(COUNT) if f"m-{i:05d}" != VICTIM]
    [letter] = dead_letters(a)
    assert letter["id"] == f"unreadable:{SUBJECT}:10" and str(path.name) in letter["reason"], letter
    assert waited >= MEND_GIVE_UP_S - 1  # the group waited for a good copy before it gave up
    assert replication(a)["damage"] == {"awaiting": 0, "mended": 0, "lost": 1}
    assert "damaged too" in a.proc.log_path.read_text()  # what the replica answered


def test_the_replica_scrub_finds_damage_and_mends_it_from_the_master(processes, group) -> None:
    a, b = group
    processes.kill(b.proc, signal.SIGTERM)
    path, position, size = locate(b.data_dir, VICTIM)  # in the oldest of >= 4 segments: only the scrub checks it
    assert len(list((b.data_dir / "messagelog").iterdir())) >= 4
    good = locate(a.data_dir, VICTIM)
    flip_last_byte(path, position, size)

    b = restart_broker(processes, b, name="b-restarted")
    wait_role(b, "replica")
    wait_for(lambda: (replication(b) or {}).get("damage", {}).get("mended") == 1, "the replica to mend its copy")

    assert path.read_bytes()[position : position + size] == good[0].read_bytes()[good[1] : good[1] + good[2]]
    assert replication(b)["damage"] == {"awaiting": 0, "mended": 1, "lost": 0}


def test_a_new_replica_catches_up_past_a_record_damaged_on_the_master(processes, tmp_path, meta) -> None:
    group_args = ("--meta", meta, "--group", "g1", "--max-lag", "1s", "--segment-mib", "1")
    a = start_broker(processes, tmp_path / "a", *group_args, name="a")  # alone: acknowledges with no replica
    wait_role(a, "master")
    fill(a)
    path, position, size = locate(a.data_dir, VICTIM)
    flip_last_byte(path, position, size)
    damaged = path.read_bytes()[position : position + size]

    b = start_broker(processes, tmp_path / "b", *group_args, name="b")
    wait_role(b, "replica")
    wait_in_sync(a, b, timeout=MEND_GIVE_UP_S + 60)

    [saved] = (a.data_dir / "quarantine").iterdir()
    assert saved.read_bytes() == damaged
    assert replication(a)["damage"] == {"awaiting": 0, "mended": 0, "lost": 1}
    for segment in sorted((a.data_dir / "messagelog").iterdir()):  # byte for byte the same logs
        assert (b.data_dir / "messagelog" / segment.name).read_bytes() == segment.read_bytes()
    assert "fails its checks" in b.proc.log_path.read_text()

    ids = consume_all(a, COUNT - 1)
    assert ids == [f"m-{i:05d}" for i in range(COUNT) if f"m-{i:05d}" != VICTIM]
    [letter] = dead_letters(a)
    assert letter["id"] == f"unreadable:{SUBJECT}:10" and "cut out as damaged" in letter["reason"], letter

    # The replica derived its consume log from the blank record: after a failover a new group on it
    # still meets the lost message as a dead letter, not as a silent hole.
    meta_in_sync(meta, "g1", b)  # promotable
    processes.kill(a.proc, signal.SIGKILL)
    wait_role(b, "master", epoch=2)
    ids = consume_all(b, COUNT - 1, group="after")
    assert ids == [f"m-{i:05d}" for i in range(COUNT) if f"m-{i:05d}" != VICTIM]
    [letter] = dead_letters(b, group="after")
    assert letter["id"] == f"unreadable:{SUBJECT}:10" and "cut out as damaged" in letter["reason"], letter
