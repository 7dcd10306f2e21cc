"""Derived data is never trusted over the message log (issue 19, cases 2 and 3): a checkpoint with a
flipped digit, with or without a CRC to catch it, is discarded and the derived logs are rebuilt (a
WARNING says so), so nothing acknowledged is hidden and no sequence number is handed out twice."""

from __future__ import annotations

import json
import logging
import shutil
import zlib

from qmq.store.index import HEADER
from qmq.store.segment import segment_name
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

SENT = 320
CLAIMED = 220  # "s":320 -> "s":220, the "exp":32000 -> "exp":22000 at a smaller scale


def fill(data_dir) -> None:
    with LogStore(data_dir, SMALL) as store:
        for b in range(SENT // 32):
            store.append_durable([Message("exp", f"m-{b * 32 + i}", b"x" * 40) for i in range(32)])


def checkpoint_path(data_dir):
    return data_dir / "checkpoint" / "checkpoint.json"


def all_ids(store: LogStore) -> list[str]:
    return [r.message_id for r in store.read("exp", 0, 100_000, max_scan=100_000).records]


def check_nothing_hidden_and_no_collision(data_dir, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="qmq.store"), LogStore(data_dir, SMALL) as store:
        assert store.next_seq("exp") == SENT
        assert len(all_ids(store)) == SENT
        store.append_durable([Message("exp", f"after-{i}", b"y") for i in range(100)])
    assert any("rebuilding the derived logs" in r.getMessage() for r in caplog.records), caplog.text
    with LogStore(data_dir, SMALL) as store:  # and after a rebuild from scratch
        ids = all_ids(store)
        assert len(ids) == SENT + 100 and len(set(ids)) == SENT + 100
        seqs = [r.seq for r in store.read("exp", 0, 100_000, max_scan=100_000).records]
        assert seqs == list(range(SENT + 100))


def test_a_flipped_digit_in_the_checkpoint_fails_its_crc(tmp_path, caplog) -> None:
    fill(tmp_path)
    path = checkpoint_path(tmp_path)
    text = path.read_text()
    assert f'"exp":{SENT}' in text
    path.write_text(text.replace(f'"exp":{SENT}', f'"exp":{CLAIMED}'))
    check_nothing_hidden_and_no_collision(tmp_path, caplog)


def test_a_checkpoint_with_a_valid_crc_claiming_fewer_messages_is_cross_checked(tmp_path, caplog) -> None:
    """A version-1 checkpoint (no CRC) or one whose CRC was recomputed: the logs must disagree."""
    fill(tmp_path)
    path = checkpoint_path(tmp_path)
    data = json.loads(path.read_text())
    data.pop("crc", None)
    data["next_seq"]["exp"] = CLAIMED
    data["crc"] = zlib.crc32(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
    path.write_text(json.dumps(data))
    check_nothing_hidden_and_no_collision(tmp_path, caplog)


def test_a_checkpoint_claiming_more_messages_is_discarded(tmp_path, caplog) -> None:
    fill(tmp_path)
    path = checkpoint_path(tmp_path)
    data = json.loads(path.read_text())
    data.pop("crc", None)
    data["version"] = 1
    data["next_seq"]["exp"] = SENT + 50
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="qmq.store"), LogStore(tmp_path, SMALL) as store:
        assert store.next_seq("exp") == SENT  # no phantom messages, no gap
        assert len(all_ids(store)) == SENT
    assert any("rebuilding the derived logs" in r.getMessage() for r in caplog.records)


def index_file_named_by_the_checkpoint(data_dir):
    state = json.loads(checkpoint_path(data_dir).read_text())["index"]
    assert state["file"] is not None and state["count"] == SENT, state
    return data_dir / "index" / segment_name(state["file"])


def check_every_id_found_after_a_rebuild(data_dir, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="qmq.store"), LogStore(data_dir, SMALL) as store:
        assert all(store.find_by_id(f"m-{i}") is not None for i in range(SENT))
    assert any("rebuilding the derived logs" in r.getMessage() for r in caplog.records), caplog.text


def test_a_checkpoint_naming_a_missing_key_index_is_discarded(tmp_path, caplog) -> None:
    """Without the check the store opened, replayed from the checkpoint, and found no message sent
    before it by id."""
    fill(tmp_path)
    index_file_named_by_the_checkpoint(tmp_path)
    shutil.rmtree(tmp_path / "index")
    check_every_id_found_after_a_rebuild(tmp_path, caplog)


def test_a_key_index_holding_fewer_entries_than_the_checkpoint_counts_is_rebuilt(tmp_path, caplog) -> None:
    fill(tmp_path)
    path = index_file_named_by_the_checkpoint(tmp_path)
    with path.open("r+b") as f:
        magic, slots, capacity, _count, last_offset = HEADER.unpack(f.read(HEADER.size))
        f.seek(0)
        f.write(HEADER.pack(magic, slots, capacity, SENT // 2, last_offset))
    check_every_id_found_after_a_rebuild(tmp_path, caplog)


def test_log_verify_reads_the_checkpoint_and_the_snapshot(tmp_path) -> None:
    import subprocess
    import sys

    def cli_verify() -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(tmp_path)]
        return subprocess.run(command, capture_output=True, text=True)

    fill(tmp_path)
    (tmp_path / "consumers").mkdir()
    (tmp_path / "consumers" / "consumers.snapshot").write_bytes(b"\\x00\\x00\\x00\\x01\\x00\\x00\\x00\\x02ab")
    ok_before = cli_verify()
    assert ok_before.returncode == 1 and "snapshot fails its CRC" in ok_before.stdout, ok_before.stdout
    (tmp_path / "consumers" / "consumers.snapshot").unlink()
    assert cli_verify().returncode == 0
    path = checkpoint_path(tmp_path)
    path.write_text(path.read_text().replace(f'"exp":{SENT}', f'"exp":{CLAIMED}'))
    result = cli_verify()
    assert result.returncode == 1 and "checkpoint fails its CRC check" in result.stdout, result.stdout
    data = json.loads(path.read_text())
    data.pop("crc", None)
    data["version"] = 1
    path.write_text(json.dumps(data))
    result = cli_verify()
    assert result.returncode == 1 and f"says 'exp' holds {CLAIMED} messages" in result.stdout, result.stdout
