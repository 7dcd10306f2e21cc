"""The broker keeps its last few consumption snapshots (qmq/broker/snapshot.py, docs/formats.md), so a
cut log (a deposed master rejoining its group) goes on from the newest one covering nothing that was
cut, and replays the journal after it, rather than wiping its directory and copying the master's
state and whole log again when retention removed the log's start (docs/replication.md, "Consumption
state on broker replicas"). On real store files, without processes.
"""

from __future__ import annotations

import time
from dataclasses import replace

import msgpack
import pytest

from qmq.broker import journal, recovery, snapshot
from qmq.broker.journal import Create
from qmq.broker.roles import BrokerDuty
from qmq.broker.service import STATE_DIR
from qmq.broker.state import BrokerState
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.store.files import sealed
from qmq.store.replication import truncate_log
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

CONFIG = replace(SMALL, retention_s=1.0)
FILLER = b"f" * 3000  # 64 KiB segments roll every ~20 of these
SUBJECT = "gen.orders"


def state_at(seq: int) -> dict:
    state = BrokerState()
    state.journal_seq = seq
    return state.to_snapshot()


def names(directory) -> dict[str, int]:
    return {path.name: snapshot.read(path)["journal_seq"] for path in snapshot.files(directory)}


# ---- the files ------------------------------------------------------------------------------------


def test_saving_keeps_the_newest_and_the_two_before_it(tmp_path) -> None:
    for seq in (1, 2, 3, 4):
        snapshot.save(tmp_path, state_at(seq), log_end=seq * 100)
    assert names(tmp_path) == {"consumers.snapshot": 4, "consumers.snapshot.1": 3, "consumers.snapshot.2": 2}
    snapshot.save(tmp_path, state_at(4), log_end=400)  # the same journal (a close after a loop save): replaced
    assert names(tmp_path) == {"consumers.snapshot": 4, "consumers.snapshot.1": 3, "consumers.snapshot.2": 2}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names(tmp_path))  # no temporary file left
    found, problems = snapshot.generations(tmp_path)
    assert [(g.journal_seq, g.log_end) for g in found] == [(4, 400), (3, 300), (2, 200)] and not problems
    assert snapshot.load(tmp_path) == state_at(4)  # the state, without the file's log end


def test_the_single_snapshot_layout_loads_and_becomes_the_previous_generation(tmp_path) -> None:
    (tmp_path / snapshot.FILE_NAME).write_bytes(sealed(msgpack.packb(state_at(7), use_bin_type=True)))
    assert snapshot.load(tmp_path) == state_at(7)
    snapshot.save(tmp_path, state_at(9), log_end=900)
    found, _ = snapshot.generations(tmp_path)
    assert [(g.path.name, g.journal_seq, g.log_end) for g in found] == [
        ("consumers.snapshot", 9, 900),
        ("consumers.snapshot.1", 7, None),
    ]


def test_a_crash_mid_rotation_leaves_whole_snapshots_and_the_newest_loads(tmp_path) -> None:
    for seq in (1, 2, 3):
        snapshot.save(tmp_path, state_at(seq), log_end=seq)
    # What `save` does before writing the new one: .1 to .2, the newest to .1; killed there.
    (tmp_path / "consumers.snapshot.1").replace(tmp_path / "consumers.snapshot.2")
    (tmp_path / "consumers.snapshot").replace(tmp_path / "consumers.snapshot.1")
    assert snapshot.load(tmp_path)["journal_seq"] == 3
    snapshot.save(tmp_path, state_at(4), log_end=4)
    assert names(tmp_path) == {"consumers.snapshot": 4, "consumers.snapshot.1": 3, "consumers.snapshot.2": 2}


def test_a_damaged_newest_snapshot_gives_way_to_the_one_before(tmp_path) -> None:
    for seq in (1, 2):
        snapshot.save(tmp_path, state_at(seq), log_end=seq)
    newest = tmp_path / snapshot.FILE_NAME
    newest.write_bytes(newest.read_bytes()[:-1])
    assert snapshot.load(tmp_path)["journal_seq"] == 1
    (tmp_path / "consumers.snapshot.1").write_bytes(b"")
    with pytest.raises(snapshot.SnapshotError, match="truncated snapshot"):
        snapshot.load(tmp_path)


@pytest.mark.parametrize(
    ("journal_end", "retained_from", "kept"),
    [
        (30, 0, [30, 20, 10]),  # nothing cut: all stay
        (25, 0, [20, 10]),  # the newest covers a cut entry: the one before it is the newest now
        (15, 0, [10]),
        (25, 15, [20]),  # the oldest's journal after it is gone: it goes too
        (25, 21, []),  # none whose journal after it is all in the log
        (5, 0, []),  # every one covers a cut entry
    ],
)
def test_a_cut_keeps_the_newest_snapshot_covering_nothing_cut_whose_journal_is_retained(
    tmp_path, journal_end, retained_from, kept
) -> None:
    for seq in (10, 20, 30):
        snapshot.save(tmp_path, state_at(seq), log_end=seq)
    chosen = snapshot.keep_within(tmp_path, journal_end, lambda seq: seq >= retained_from)
    assert (chosen.journal_seq if chosen else None) == (kept[0] if kept else None)
    assert list(names(tmp_path).values()) == kept  # in slot order: the chosen one is the newest file
    if chosen:
        assert chosen.path == tmp_path / snapshot.FILE_NAME and snapshot.load(tmp_path)["journal_seq"] == kept[0]


def test_a_replicated_master_sets_aside_the_newest_snapshot_every_replica_held(tmp_path) -> None:
    def save(seq: int, upto: int | None) -> dict[str, int]:
        snapshot.save(tmp_path, state_at(seq), log_end=seq * 100, replicated_upto=upto)
        return names(tmp_path)

    # The replicas hold the log up to 150 and no further (a split): the snapshot of journal 1 (log
    # end 100) is the newest at or below it, and the rotation that would drop it sets it aside.
    for seq in (1, 2, 3):
        save(seq, 150)
    assert save(4, 150) == {
        "consumers.snapshot": 4,
        "consumers.snapshot.1": 3,
        "consumers.snapshot.2": 2,
        "consumers.snapshot.replicated": 1,
    }
    assert save(5, 150)["consumers.snapshot.replicated"] == 1  # 2 (log end 200) is past 150: dropped
    assert save(6, 350)["consumers.snapshot.replicated"] == 3  # the replicas moved on: a newer one
    assert save(7, None)["consumers.snapshot.replicated"] == 3  # no replica heard from: left as it is
    assert "consumers.snapshot.replicated" not in save(8, 700)  # one kept in the slots is at or below
    assert snapshot.load(tmp_path)["journal_seq"] == 8


def test_a_snapshot_whose_log_end_cannot_be_peeked_is_not_set_aside(tmp_path) -> None:
    for seq in (1, 2, 3):  # as saved before the log end was written first
        body = {**state_at(seq), "filler": "x" * snapshot.PEEK_BYTES, "log_end": seq * 100}
        name = snapshot.FILE_NAMES[3 - seq]
        (tmp_path / name).write_bytes(sealed(msgpack.packb(body, use_bin_type=True)))
    snapshot.save(tmp_path, state_at(4), log_end=400, replicated_upto=150)  # only 1's log end is at or below
    assert names(tmp_path) == {"consumers.snapshot": 4, "consumers.snapshot.1": 3, "consumers.snapshot.2": 2}


# ---- a cut log of a broker whose log retention removed the start (BrokerDuty._cut_state) ----------


class Log:
    """A broker's store with journal entries (each creates a group), and its state as it goes."""

    def __init__(self, data_dir) -> None:
        self.data_dir = data_dir
        self.store = LogStore(data_dir, CONFIG)
        self.state = BrokerState()
        self.starts: dict[int, int] = {}  # journal sequence -> the log offset of its record

    def journal(self, count: int, filler: int = 0) -> None:
        for _ in range(count):
            seq = self.store.next_seq(ACTION_SUBJECT)
            entry = Create(SUBJECT, f"g{seq}", 0, False)
            self.store.append([Message(SUBJECT, f"m{seq}-{i}", FILLER) for i in range(filler)] or [])
            appended = self.store.append([Message(ACTION_SUBJECT, f"%a{seq}", journal.encode([entry]))])
            self.starts[seq] = appended[0].offset
            self.state.apply(entry, 0.0)
            self.state.journal_seq = seq + 1

    def save(self, replicated_upto: int | None = None) -> int:
        state, end = self.state.to_snapshot(), self.store.end_offset
        snapshot.save(self.data_dir / STATE_DIR, state, log_end=end, replicated_upto=replicated_upto)
        return self.state.journal_seq

    def expire(self) -> None:
        self.store.checkpoint()
        assert self.store.clean(now=time.time() + 10) > 0
        assert self.store.start_offset > 0


def groups_recovered(data_dir) -> list[str]:
    with LogStore(data_dir, CONFIG) as store:
        state = recovery.recover(store, data_dir / STATE_DIR, 0.0)
    return sorted((key for _subject, key in state.groups), key=lambda k: int(k[1:]))


def test_a_cut_goes_on_from_the_newest_snapshot_covering_nothing_cut_without_a_wipe(tmp_path) -> None:
    log = Log(tmp_path)
    log.journal(20, filler=3)  # rolls several segments
    log.expire()  # retention removed the log's start: a lost snapshot would mean a wipe and a copy
    log.journal(3)
    first = log.save()
    log.journal(3)
    second = log.save()
    log.journal(3)
    third = log.save()
    log.store.close()
    cut_at = log.starts[second + 1]  # what the new master has: up to the record after `second`
    truncate_log(tmp_path, cut_at)

    assert BrokerDuty({}, CONFIG)._cut_state(tmp_path, cut_at) is False  # not wiped
    assert names(tmp_path / STATE_DIR) == {"consumers.snapshot": second, "consumers.snapshot.1": first}
    assert third > second + 1
    assert groups_recovered(tmp_path) == [f"g{seq}" for seq in range(second + 1)]  # the journal after it replayed
    assert (tmp_path / "messagelog").is_dir()


@pytest.mark.parametrize("case", ["every-snapshot-covers-the-cut", "the-older-ones-journal-expired"])
def test_a_cut_with_no_snapshot_to_go_on_from_wipes_the_directory_as_before(tmp_path, case) -> None:
    log = Log(tmp_path)
    if case == "the-older-ones-journal-expired":
        log.journal(5, filler=3)
        log.save()  # its journal after it expires below
    log.journal(20, filler=3)
    log.expire()
    log.journal(3)
    newest = log.save()
    log.journal(3)
    log.store.close()
    cut_at = log.starts[newest - 1]  # the newest covers a cut entry
    truncate_log(tmp_path, cut_at)

    assert BrokerDuty({}, CONFIG)._cut_state(tmp_path, cut_at) is True
    assert not (tmp_path / STATE_DIR).exists() and not (tmp_path / "messagelog").exists()


def test_a_long_split_goes_on_from_the_snapshot_set_aside_at_what_the_replica_held(tmp_path) -> None:
    """A deposed master that went on journalling (consumers still using it) for more snapshots than
    it keeps, while its replica, promoted, held the log only up to `held`."""
    log = Log(tmp_path)
    log.journal(20, filler=3)
    log.expire()
    log.journal(3)
    held = log.store.end_offset  # what the replica holds when the split begins
    before_split = log.save(held)
    for _ in range(2 * snapshot.KEPT_SNAPSHOTS):  # the split: the journal moves, the replica's report does not
        log.journal(2)
        log.save(held)
    log.store.close()
    assert "consumers.snapshot.replicated" in names(tmp_path / STATE_DIR)
    truncate_log(tmp_path, held)  # the new master had what the replica held

    assert BrokerDuty({}, CONFIG)._cut_state(tmp_path, held) is False  # not wiped
    assert names(tmp_path / STATE_DIR) == {"consumers.snapshot": before_split}
    assert groups_recovered(tmp_path) == [f"g{seq}" for seq in range(before_split)]
