"""How fast the background scrub CRC-checks sealed segments, unpaced (its ceiling; the store paces it
at `SCRUB_BYTES_PER_S`), and how long opening a store with a full rebuild of the derived logs takes
after a discarded checkpoint. Prints its figures; nothing is asserted.

    .venv/bin/python bench/store_scrub.py [--mib 128] [--payload 512]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from qmq.store.scrub import Scrub
from qmq.store.store import LogStore, Message, StoreConfig

CONFIG = StoreConfig(segment_bytes=16 * 1024 * 1024, background=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=128)
    parser.add_argument("--payload", type=int, default=512)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "store"
        with LogStore(data_dir, CONFIG) as store:
            n = 0
            while store.end_offset < args.mib * 1024 * 1024:
                store.append([Message("bench", f"m-{n + i}", b"p" * args.payload) for i in range(1000)])
                n += 1000
            store.checkpoint()
        with LogStore(data_dir, CONFIG) as store:
            scrub = Scrub(store.message_log, store.end_offset, lambda *a: None, bytes_per_s=1e15)
            scrub.start()
            scrub.done.wait()
            mib = scrub.checked_bytes / 2**20
            print(
                f"scrub: {mib:.0f} MiB, {n} records in {scrub.seconds:.2f} s = {mib / scrub.seconds:.0f} MiB/s unpaced"
            )
        (data_dir / "checkpoint" / "checkpoint.json").write_text("{damaged")
        started = time.monotonic()
        with LogStore(data_dir, dataclasses.replace(CONFIG)):
            pass
        seconds = time.monotonic() - started
        print(f"open with a discarded checkpoint (full rebuild): {seconds:.1f} s = {mib / seconds:.0f} MiB/s")


if __name__ == "__main__":
    main()
