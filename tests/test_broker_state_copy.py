"""A broker replica that retention left behind copies the master's consumption state
(qmq/broker/state_copy.py), on real files without sockets: installed, the replica's store begins at
the master's log start with every subject's sequence where the master's is there (subjects with no
record left included), and the retained log copied after it makes its consume logs the master's;
an install cut short by a crash leaves the directory empty at the next start, never half copied."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from qmq.broker import snapshot, state_copy
from qmq.broker.journal import Create
from qmq.broker.state import BrokerState
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.replication import install as install_marker
from qmq.store import epochs as ep
from qmq.store.segment import segment_name
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

CONFIG = replace(SMALL, retention_s=1.0)
BODY = b"p" * 2000  # 64 KiB segments roll every ~30 messages


def make_master(path) -> tuple[LogStore, BrokerState]:
    """A master whose first segments retention removed: `old.subject` has no record left, the others
    go on past the log start."""
    store = LogStore(path, CONFIG)
    state = BrokerState()
    store.append([Message("old.subject", f"old-{i}", BODY) for i in range(40)])
    for i in range(200):
        store.append([Message("busy.subject", f"busy-{i}", BODY), Message(ACTION_SUBJECT, f"%a{i}", b"\x90")])
    state.apply(Create("old.subject", "g", 40, False), 0.0)
    state.journal_seq = store.next_seq(ACTION_SUBJECT)
    store.checkpoint()
    assert store.clean(now=time.time() + 10) > 0  # every sealed segment expired
    assert store.start_offset > 0 and store.first_seq("old.subject") >= 0
    return store, state


def copy_of(store: LogStore, state: BrokerState) -> state_copy.StateCopy:
    log_start = store.start_offset
    floors = state_copy.sequence_floors(store, log_start)
    data = state_copy.pack_copy(state.to_snapshot(), log_start=log_start, offset=store.end_offset, floors=floors)
    copies = state_copy.Copies()
    name = copies.add(1, data)
    read = b""
    while len(read) < len(data):
        read += copies.read({"name": name, "offset": len(read)})["data"]
    return state_copy.unpack_copy(read, [(1, 0)])


def test_an_installed_copy_goes_on_with_the_masters_sequences_and_consume_logs(tmp_path) -> None:
    master, state = make_master(tmp_path / "master")
    copy = copy_of(master, state)
    replica_dir = tmp_path / "replica"
    LogStore(replica_dir, CONFIG).close()  # an old, wiped-out store of its own
    state_copy.install(replica_dir, CONFIG, copy)
    assert not (replica_dir / install_marker.INSTALLING).exists()
    assert snapshot.load(replica_dir / "consumers")["journal_seq"] == state.journal_seq
    assert ep.load(replica_dir) == [(1, 0)]

    with LogStore(replica_dir, CONFIG) as replica:
        assert replica.start_offset == replica.end_offset == master.start_offset
        assert replica.next_seq("old.subject") == master.next_seq("old.subject") == 40  # no record left
        first_busy = master.read("busy.subject", 0, 1).records[0].seq
        assert replica.next_seq("busy.subject") == first_busy
        replica.append_replicated(master.read_bytes(master.start_offset, master.end_offset), master.start_offset)
        assert replica.subjects() == master.subjects()
        for subject in ("busy.subject", ACTION_SUBJECT):
            mine = replica.read(subject, 0, 1000).records
            theirs = master.read(subject, 0, 1000).records
            assert [(r.seq, r.offset, r.message_id) for r in mine] == [(r.seq, r.offset, r.message_id) for r in theirs]
        replica.append([Message("old.subject", "new-0", b"x")])  # promoted: the group's cursor sees it
        assert [r.message_id for r in replica.read("old.subject", 40, 10).records] == ["new-0"]
    with LogStore(replica_dir, CONFIG) as reopened:  # the checkpoint and consume logs check out
        assert reopened.next_seq("old.subject") == 41
    master.close()


def test_a_damaged_copy_is_refused(tmp_path) -> None:
    master, state = make_master(tmp_path / "master")
    data = bytearray(state_copy.pack_copy(state.to_snapshot(), log_start=1, offset=2, floors=[]))
    data[-3] ^= 0xFF
    with pytest.raises(state_copy.CopyError):
        state_copy.unpack_copy(bytes(data), [])
    assert state_copy.Copies().read({"name": "consumers-1-9", "offset": 0})["gone"]
    master.close()


def test_an_install_cut_short_leaves_the_directory_empty_at_the_next_start(tmp_path, monkeypatch) -> None:
    master, state = make_master(tmp_path / "master")
    copy = copy_of(master, state)
    master.close()
    replica_dir = tmp_path / "replica"
    with LogStore(replica_dir, CONFIG) as old:
        old.append([Message("mine", "m-0", b"x")])

    def crash(*args) -> None:  # the process dies once the log and floors are in place
        raise SystemExit("killed")

    monkeypatch.setattr(state_copy.ep, "save", crash)
    with pytest.raises(SystemExit):
        state_copy.install(replica_dir, CONFIG, copy)
    monkeypatch.undo()
    (replica_dir / "messagelog").mkdir(exist_ok=True)  # what a crash could leave: part of the copy
    (replica_dir / "messagelog" / segment_name(copy.log_start)).write_bytes(b"")
    assert (replica_dir / install_marker.INSTALLING).exists()

    assert state_copy.discard_interrupted(replica_dir)
    assert not (replica_dir / install_marker.INSTALLING).exists()
    assert not state_copy.discard_interrupted(replica_dir)  # nothing left to discard
    with LogStore(replica_dir, CONFIG) as fresh:  # empty: the replica fetches from 0, is refused, copies
        assert fresh.start_offset == fresh.end_offset == 0 and fresh.subjects() == {}
    assert snapshot.load(replica_dir / "consumers") is None
