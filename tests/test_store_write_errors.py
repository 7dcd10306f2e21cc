"""Write errors injected through `LogStore.write_hook` (docs/operating.md): out of space makes the
store read-only until a probe finds space; an I/O error until it is reopened; a failed append is
taken back whole, so the store stays consistent (issue 19, case 1)."""

from __future__ import annotations

import errno

import pytest

from qmq.store.store import LogStore, Message, StoreError
from qmq.store.verify import verify
from tests.support.stores import SMALL


def failing(code: int):
    def hook(what: str) -> None:
        raise OSError(code, f"injected: {errno.errorcode[code]} on {what}")

    return hook


def test_out_of_space_is_cured_by_space_and_an_io_error_only_by_reopening(tmp_path) -> None:
    with LogStore(tmp_path, SMALL) as store:
        store.append_durable([Message("s", "before", b"x")])
        end = store.end_offset
        store.write_hook = failing(errno.ENOSPC)
        with pytest.raises(StoreError, match=r"read-only.*ENOSPC"):
            store.append_durable([Message("s", "refused", b"x")])
        assert store.end_offset == end and store.next_seq("s") == 1
        store.write_hook = None
        assert "ENOSPC" in store.read_only_reason and store.out_of_space
        with pytest.raises(StoreError):
            store.append_durable([Message("s", "still refused", b"x")])
        assert store.probe_space(), "space is there: the probe clears the state"
        store.append_durable([Message("s", "after", b"x")])

        store.write_hook = failing(errno.EIO)
        with pytest.raises(StoreError, match="EIO"):
            store.append_durable([Message("s", "io error", b"x")])
        store.write_hook = None
        assert not store.probe_space() and not store.out_of_space
        with pytest.raises(StoreError, match=r"until reopened|EIO"):
            store.append_durable([Message("s", "refused after EIO", b"x")])
    with LogStore(tmp_path, SMALL) as store:
        assert [r.message_id for r in store.read("s", 0).records] == ["before", "after"]
        store.append_durable([Message("s", "reopened", b"x")])
    assert verify(tmp_path).ok


def test_a_checkpoint_that_meets_a_full_disk_turns_the_store_read_only(tmp_path) -> None:
    with LogStore(tmp_path, SMALL) as store:
        store.append_durable([Message("s", "m", b"x")])
        store.write_hook = failing(errno.ENOSPC)
        with pytest.raises(OSError):
            store.checkpoint()
        assert "checkpoint failed" in store.read_only_reason
        store.write_hook = None
        assert store.probe_space()
        store.checkpoint()
