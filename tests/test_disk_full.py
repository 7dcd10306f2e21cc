"""A full disk (a real 40 MiB tmpfs the test mounts) makes the broker read-only, never kills it:
sends are answered UNAVAILABLE with the cause, BROKER_STATS says `read_only` and why, consumers keep
reading, and once space is freed the broker takes sends again without a restart (issue 19, case 1)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError
from tests.support import waiting
from tests.support.broker import RawConsumer, send, start_broker

FS_BYTES = 40 * 1024 * 1024
LEFT_FREE_BYTES = 3 * 1024 * 1024  # after the index is made and the ballast written
PAYLOAD = b"p" * 32 * 1024
DEADLINE_S = 30.0


@contextlib.contextmanager
def small_file_system(path: Path) -> Iterator[Path]:
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def wait_until(condition, what: str):
    return waiting.wait_until(condition, what, DEADLINE_S)


def test_full_disk_turns_the_broker_read_only_and_freeing_space_brings_it_back(processes, tmp_path) -> None:
    with small_file_system(tmp_path / "fs") as fs:
        broker = start_broker(processes, fs / "broker")
        conn = broker.connect()
        send(conn, "orders", ["first"], payload=PAYLOAD)  # makes the key index (its space is reserved)
        ballast = fs / "ballast"
        with ballast.open("wb") as f:
            f.write(bytes(max(0, free_bytes(fs) - LEFT_FREE_BYTES)))
        stored, n = ["first"], 0
        with pytest.raises(RemoteError) as refused:
            while n < 10_000:
                ids = [f"m{n + i}" for i in range(4)]
                send(conn, "orders", ids, payload=PAYLOAD)
                stored.extend(ids)
                n += 4
        assert refused.value.code == ErrorCode.UNAVAILABLE, refused.value
        assert "No space left" in refused.value.message
        assert broker.proc.poll() is None, "the broker died"
        stats = conn.request(RequestCode.BROKER_STATS, {})
        assert stats["read_only"] is True
        assert "No space left" in stats["read_only_reason"]
        with pytest.raises(RemoteError) as again:  # still refused, still answered
            send(conn, "orders", ["refused"], payload=b"x")
        assert again.value.code == ErrorCode.UNAVAILABLE

        consumer = RawConsumer(conn, "orders", "g", "c1", {"start": "earliest"})
        got = consumer.drain(len(stored), wait_ms=200)
        assert [d.id for d in got] == stored, "a consumer reads everything stored while the disk is full"

        ballast.unlink()
        wait_until(lambda: not conn.request(RequestCode.BROKER_STATS, {})["read_only"], "the broker to take writes")
        assert send(conn, "orders", ["after"], payload=PAYLOAD)["stored"] == 1
        assert [d.id for d in consumer.drain(1, wait_ms=500)] == ["after"]
        conn.close()
