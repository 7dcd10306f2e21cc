"""A store that fails to write (here a file-size limit: EFBIG, not a full disk, so it does not come
back by itself) takes the failed append back, refuses it and every later one with a StoreError, and,
opened again, is consistent: the refused message is nowhere, the store verifies and takes writes."""

from __future__ import annotations

import subprocess
import sys

from qmq.store.store import LogStore, Message
from qmq.store.verify import verify
from tests.support.stores import SMALL

FILE_SIZE_LIMIT = 16 * 1024  # under the size of SMALL's key index file: not made at open, the first append fails on it

CHILD = """
import sys
from qmq.store.store import LogStore, Message, StoreError
from tests.support.stores import SMALL

store = LogStore(sys.argv[1], SMALL)
for message_id in ("first", "second"):
    try:
        store.append_durable([Message("orders", message_id, b"x" * 100)])
        print("STORED", message_id)
    except StoreError as exc:
        print("REFUSED", message_id, exc)
store.close()
"""


def test_a_failed_append_makes_the_store_read_only_and_reopening_derives_it(tmp_path) -> None:
    data_dir = tmp_path / "store"
    child = subprocess.run(
        ["prlimit", f"--fsize={FILE_SIZE_LIMIT}", sys.executable, "-c", CHILD, str(data_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = child.stdout.splitlines()
    assert lines[0].startswith("REFUSED first the store is read-only: append failed: [Errno 27] File too large")
    assert lines[1].startswith("REFUSED second the store is read-only: append failed"), child.stdout
    with LogStore(data_dir, SMALL) as store:
        assert store.find_by_id("first") is None  # refused, so taken back from the message log too
        assert store.read("orders", 0).records == []
        store.append_durable([Message("orders", "third", b"y")])
        assert [r.message_id for r in store.read("orders", 0).records] == ["third"]
    assert verify(data_dir).ok
