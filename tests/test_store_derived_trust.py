"""Derived data is never trusted over the message log (issue 19, case 2): a checkpoint with a flipped
digit, or one that is whole but does not match the consume logs, is discarded and the derived logs
rebuilt, so no acknowledged message is hidden and no sequence number is used twice."""

import json

from qmq.store import checkpoint as ckpt
from qmq.store.store import LogStore, Message
from qmq.store.verify import verify
from tests.support.stores import SMALL

SENT = 3_000


def fill(data_dir, count=SENT):
    with LogStore(data_dir, SMALL) as store:
        for start in range(0, count, 500):
            store.append_durable([Message("exp", f"m-{i:06d}", b"x") for i in range(start, start + 500)])
    return count


def all_ids(store, subject="exp"):
    found = []
    seq = store.first_seq(subject)
    while seq < store.next_seq(subject):
        for record in store.records(subject, range(seq, min(seq + 256, store.next_seq(subject)))):
            found.append(record.message_id)
        seq += 256
    return found


def test_a_flipped_digit_in_the_checkpoint_is_caught_by_its_crc(tmp_path):
    fill(tmp_path)
    path = tmp_path / "checkpoint" / ckpt.FILE_NAME
    text = path.read_text()
    assert f'"exp":{SENT}' in text
    path.write_text(text.replace(f'"exp":{SENT}', f'"exp":{SENT - 1000}'))  # the operator's bad day
    with LogStore(tmp_path, SMALL) as store:
        assert store.next_seq("exp") == SENT  # not 2,000: nothing hidden
        store.append_durable([Message("exp", f"new-{i}", b"y") for i in range(100)])
        ids = all_ids(store)
    assert len(ids) == SENT + 100 == len(set(ids))  # every acknowledged message, each seq once
    with LogStore(tmp_path, SMALL) as store:  # and after another open (the rebuild of the report)
        assert len(set(all_ids(store))) == SENT + 100
    assert verify(tmp_path).ok


def test_a_whole_checkpoint_that_disagrees_with_the_consume_logs_is_discarded(tmp_path, caplog):
    """A checkpoint with a valid CRC but a wrong next_seq (an old file put back, a bug): the consume
    logs show it cannot be true."""
    fill(tmp_path)
    saved = ckpt.load(tmp_path / "checkpoint")
    saved.next_seq["exp"] = SENT - 1000
    ckpt.save(tmp_path / "checkpoint", saved)  # whole, CRC and all
    with LogStore(tmp_path, SMALL) as store:
        assert store.next_seq("exp") == SENT
        results = store.append_durable([Message("exp", "after", b"y")])
        assert store.records("exp", [SENT])[0].message_id == "after"
        assert results[0].seq == SENT
    assert "discarding the checkpoint" in caplog.text


def test_version_1_checkpoints_are_still_read(tmp_path):
    fill(tmp_path)
    path = tmp_path / "checkpoint" / ckpt.FILE_NAME
    data = json.loads(path.read_text())
    del data["crc"]
    data["version"] = 1
    path.write_text(json.dumps(data))
    with LogStore(tmp_path, SMALL) as store:
        assert store.next_seq("exp") == SENT
        assert len(all_ids(store)) == SENT
