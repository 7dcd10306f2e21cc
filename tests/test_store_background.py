"""The store's background thread checkpoints by size as well as by time."""

import dataclasses

from qmq.store import checkpoint as ckpt
from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL


def test_checkpoint_follows_appended_bytes(tmp_path):
    config = dataclasses.replace(SMALL, background=True, checkpoint_interval_s=3600, checkpoint_bytes=4096)
    with LogStore(tmp_path, config) as store:
        results = store.append_durable([Message("s", f"id-{i}", b"x" * 200) for i in range(64)])
        end = results[-1].end
        assert store.wait_checkpoint(end, timeout=30)
        saved = ckpt.load(tmp_path / "checkpoint")
        assert saved.offset >= end
        assert saved.next_seq == {"s": 64}
