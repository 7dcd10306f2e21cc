"""A delay server's snapshot for a replica that retention left behind (delay_server/snapshot.py), on
real files without sockets: the listing and reads never go past what was filed at the listing, and
an install cut short by a crash leaves the directory empty at the next start, never half copied."""

from __future__ import annotations

import pytest

from delay_server import snapshot
from delay_server.schedule_log import CHECKPOINT_FILE
from qmq.protocol.errors import ProtocolError
from qmq.replication import install as install_marker
from qmq.store import epochs as ep
from qmq.store.segment import segment_name
from qmq.store.store import LogStore
from tests.support.stores import SMALL


def make_master_dir(root):
    for part, name, data in (
        ("schedule", "schedule.json", b'{"format": 1, "bucket_minutes": 60}'),
        ("schedule", CHECKPOINT_FILE, b'{"version": 1, "offset": 7}'),
        ("schedule", "202601010000.log", b"L" * 100),
        ("dispatch", "202601010000.done", b""),
        ("cancels", "202612.log", b"C" * 10),
    ):
        (root / part).mkdir(parents=True, exist_ok=True)
        (root / part / name).write_bytes(data)
    (root / "messagelog").mkdir()
    for base in (0, 4096, 8192):
        (root / "messagelog" / segment_name(base)).write_bytes(b"")
    return root


def test_the_listing_names_the_files_filed_so_far_and_the_segment_holding_the_filed_offset(tmp_path) -> None:
    master = make_master_dir(tmp_path)
    head = snapshot.listing(master, 5000, 3, [(1, 0), (3, 4000)])
    assert head["offset"] == 5000 and head["log_start"] == 4096 and head["epoch"] == 3
    assert head["epochs"] == [[1, 0], [3, 4000]]
    assert dict(head["files"]) == {
        "schedule/schedule.json": 35,
        "schedule/202601010000.log": 100,  # the master's own checkpoint is not copied
        "dispatch/202601010000.done": 0,
        "cancels/202612.log": 10,
    }


def test_a_read_stops_at_the_listed_size_says_gone_and_refuses_other_files(tmp_path) -> None:
    master = make_master_dir(tmp_path)
    (master / "schedule" / "202601010000.log").write_bytes(b"L" * 100 + b"appended after the listing")
    reply = snapshot.read_part(master, {"name": "schedule/202601010000.log", "offset": 90, "size": 100})
    assert reply == {"data": b"L" * 10, "gone": False}
    assert snapshot.read_part(master, {"name": "schedule/209901010000.log", "offset": 0, "size": 5})["gone"]
    for name in ("schedule/../store.json", "messagelog/" + segment_name(0), "/etc/passwd"):
        with pytest.raises(ProtocolError):
            snapshot.read_part(master, {"name": name, "offset": 0, "size": 1})


def test_an_install_cut_short_leaves_the_directory_empty_and_a_start_finishes_wiping_it(tmp_path, monkeypatch) -> None:
    replica = tmp_path / "replica"
    LogStore(replica, SMALL).close()  # an old log store, and old delay files
    (replica / "schedule").mkdir()
    (replica / "schedule" / "old.log").write_bytes(b"old")
    partial = replica / snapshot.PARTIAL_DIR
    for part in snapshot.STATE_DIRS:
        (partial / part).mkdir(parents=True)
    (partial / "schedule" / "new.log").write_bytes(b"new")
    copy = snapshot.Snapshot(offset=5000, log_start=4096, epochs=[(2, 0)], files=1, bytes=3)

    def crash(*args, **kwargs):
        raise KeyboardInterrupt  # as a signal would, half-way through moving the copy in

    monkeypatch.setattr(snapshot.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        snapshot.install(replica, copy)
    monkeypatch.undo()
    assert (replica / install_marker.INSTALLING).exists()
    assert not any((replica / part).exists() for part in (*install_marker.STORE_DIRS, *snapshot.STATE_DIRS))

    # A kill in the middle leaves whatever it leaves, with the marker: the next start wipes it all.
    (replica / "schedule").mkdir()
    (replica / "schedule" / "new.log").write_bytes(b"half")
    assert snapshot.discard_interrupted(replica)
    assert not (replica / install_marker.INSTALLING).exists() and not (replica / "schedule").exists()
    assert not snapshot.discard_interrupted(replica)
    with LogStore(replica, SMALL) as store:  # empty: the replica fetches from 0 and copies again
        assert (store.start_offset, store.end_offset) == (0, 0)


def test_an_installed_copy_opens_as_a_log_store_beginning_at_the_copys_segment(tmp_path) -> None:
    replica = tmp_path / "replica"
    LogStore(replica, SMALL).close()
    partial = replica / snapshot.PARTIAL_DIR
    for part in snapshot.STATE_DIRS:
        (partial / part).mkdir(parents=True)
    (partial / "schedule" / CHECKPOINT_FILE).write_text('{"version": 1, "offset": 5000}')
    snapshot.install(replica, snapshot.Snapshot(offset=5000, log_start=4096, epochs=[(2, 0)], files=0, bytes=0))
    assert not (replica / install_marker.INSTALLING).exists() and not partial.exists()
    assert ep.load(replica) == [(2, 0)]
    with LogStore(replica, SMALL) as store:
        assert (store.start_offset, store.end_offset) == (4096, 4096)
