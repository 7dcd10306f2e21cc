"""Client requests carry their group's epoch (docs/replication.md, Fencing): a master refuses one
that names a newer epoch than its own, since the meta server has then made another member master,
and takes nothing from it; an older or missing epoch is only a stale route and is served. Real
processes: a meta server on PostgreSQL and a group of two brokers."""

from __future__ import annotations

import signal

import pytest

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from qmq.store import epochs as ep
from tests.support.broker import send
from tests.support.replication import replication, start_group, start_member, wait_for, wait_role

SUBJECT = "epoch.orders"


def test_a_master_refuses_requests_naming_a_newer_epoch_and_stores_nothing_from_them(processes, tmp_path, meta) -> None:
    a, _ = start_group(processes, tmp_path, meta)
    assert replication(a)["epoch"] == 1
    with a.connect() as conn:
        assert conn.request(RequestCode.BROKER_SEND, {"messages": message("current"), "epoch": 1})["stored"] == 1
        end = replication(a)["log_end"]
        newer = [
            (RequestCode.BROKER_SEND, {"messages": message("from-the-future"), "epoch": 2}),
            (RequestCode.BROKER_PULL, {"subject": SUBJECT, "group": "g", "consumer": "c", "max": 10, "epoch": 2}),
            (RequestCode.BROKER_ACK, {"acks": [[SUBJECT, "g", "c", 0]], "epoch": 2}),
        ]
        for code, body in newer:
            with pytest.raises(RemoteError) as refused:
                conn.request(code, body)
            assert refused.value.code == ErrorCode.NOT_MASTER, refused.value
            assert "epoch 1" in refused.value.message and "epoch 2" in refused.value.message
        assert replication(a)["log_end"] == end  # nothing of the refused send was written
        assert conn.request(RequestCode.BROKER_SEND, {"messages": message("stale-route"), "epoch": 0})["stored"] == 1
        assert send(conn, SUBJECT, ["no-epoch"])["stored"] == 1  # a client that names none
    stats = replication(a)
    assert stats["role"] == "master" and stats["epoch"] == 1  # a client's word alone deposes no one


def message(message_id: str) -> list[dict]:
    return [{"id": message_id, "subject": SUBJECT, "payload": b"x", "tags": [], "key": None}]


def test_epoch_lines_past_the_recovered_log_end_are_cut_before_a_new_epoch_is_filed(processes, tmp_path, meta) -> None:
    """A replica saves the master's epoch lines once it has written their records, maybe before its
    fsync: a machine crash can leave a line that begins past the log the replica recovers. Promoted
    later, it must file its own epoch where its log ends, not keep that line (a deposed master asking
    where epoch 1 ends would be told too far, and keep records the new master has not)."""
    a, b = start_group(processes, tmp_path, meta)
    with a.connect() as conn:
        assert send(conn, SUBJECT, [f"m{i}" for i in range(20)])["stored"] == 20
    wait_for(lambda: (replication(b) or {}).get("durable") == replication(a)["log_end"], "b to hold a's log")
    end = replication(b)["log_end"]
    processes.kill(b.proc, signal.SIGKILL)
    epochs_file = tmp_path / "b" / ep.FILE_NAME
    assert ep.parse(epochs_file.read_text()) == [(1, 0)]
    epochs_file.write_text(f"1 0\n2 {end + 4096}\n")  # as a crash leaves it: epoch 2's records lost
    processes.kill(a.proc, signal.SIGKILL)
    b = start_member(processes, tmp_path / "b", meta, "g1", port=b.port, name="b-again")
    stats = wait_role(b, "master", epoch=2)
    assert stats["log_end"] == end
    assert ep.parse(epochs_file.read_text()) == [(1, 0), (stats["epoch"], end)]
