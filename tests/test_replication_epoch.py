"""Client requests carry their group's epoch (docs/replication.md, Fencing): a master refuses one
that names a newer epoch than its own, since the meta server has then made another member master,
and takes nothing from it; an older or missing epoch is only a stale route and is served. Real
processes: a meta server on PostgreSQL and a group of two brokers."""

from __future__ import annotations

import pytest

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support.broker import send
from tests.support.replication import replication, start_group

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
