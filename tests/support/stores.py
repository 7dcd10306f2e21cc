"""Small store settings for tests: tiny segments so rolling, retention and index rolls happen often."""

from qmq.store.store import StoreConfig

SMALL = StoreConfig(
    segment_bytes=64 * 1024,
    consume_segment_entries=128,
    index_slots=256,
    index_capacity=1024,
    background=False,
)


def payload_for(message_id: str) -> bytes:
    """A payload derived from the id, so a reader can tell a record is byte-identical without a copy."""
    import hashlib

    digest = hashlib.sha256(message_id.encode()).digest()
    return (digest * (1 + digest[0] % 40))[: 16 + digest[1] * 4]


def assert_log_verifies(data_dir) -> None:
    """`qmq log verify` of a (stopped) server's data directory finds nothing wrong."""
    import subprocess
    import sys

    verified = subprocess.run(
        [sys.executable, "-m", "qmq", "log", "verify", "--data-dir", str(data_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert verified.returncode == 0, verified.stdout + verified.stderr


FLUSHERS = ("c", "python")  # the fsync thread of `--flush sync`: C (qmq/store/_sync_thread.pyx) or its original


def use_flusher(kind: str, monkeypatch) -> None:
    """Stores opened from now on in this test fsync with the C thread ("c") or the Python one."""
    from qmq.store import native_flush

    if kind == "python":
        monkeypatch.setattr(native_flush, "sync_thread", None)
    else:
        assert native_flush.sync_thread is not None, (
            "qmq.store._sync_thread is not built (pip install -e . with Cython)"
        )
