"""A store that fails to write (here a file-size limit, as a full disk would) refuses that append and
every later one with a StoreError, records no checkpoint past what its derived logs hold, and, opened
again, has every record it appended, derived and found."""

from __future__ import annotations

import subprocess
import sys

from qmq.store.store import LogStore
from qmq.store.verify import verify
from tests.support.stores import SMALL

FILE_SIZE_LIMIT = 16 * 1024  # under the size of SMALL's key index file, which the first append makes

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
    assert lines[0].startswith("REFUSED first append failed: [Errno 27] File too large"), child.stdout
    assert lines[1].startswith("REFUSED second the store failed to write earlier"), child.stdout
    with LogStore(data_dir, SMALL) as store:
        record = store.find_by_id("first")  # in the message log before the index failed: derived again
        assert record is not None and record.payload == b"x" * 100
        assert [r.message_id for r in store.read("orders", 0).records] == ["first"]
    assert verify(data_dir).ok
