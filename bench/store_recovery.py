"""Recovery time after a SIGKILL with ~1 GiB written after the last checkpoint.

A child process appends 1 KiB records (async flush, no background checkpoints) until `--gib` GiB lie
after its only checkpoint, reports, and is SIGKILLed. The parent then times `LogStore(...)`: the CRC
check of everything after the checkpoint and the replay into consume logs and the key index. Prints
the figure; record it in docs/benchmarks.md.

    .venv/bin/python bench/store_recovery.py [--gib 1.0] [--subjects 100]
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from qmq.store.flush import FlushMode
from qmq.store.store import LogStore, Message, StoreConfig

CONFIG = StoreConfig(flush=FlushMode.ASYNC, background=False)


def child(data_dir: str, gib: float, subjects: int) -> None:
    store = LogStore(data_dir, CONFIG)
    payload = os.urandom(1024)
    target = store.message_log.end_offset + int(gib * 1024**3)
    n = 0
    while store.message_log.end_offset < target:
        store.append(
            [
                Message(
                    f"bench.subject-{(n + i) % subjects}",
                    f"01JDX7Q3ZP4Y8N2K5M{n + i:010d}",
                    payload,
                    key=f"order-{(n + i) % 100000}",
                )
                for i in range(64)
            ]
        )
        n += 64
    print(f"WRITTEN {n} {store.message_log.end_offset}", flush=True)
    signal.pause()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--subjects", type=int, default=100)
    parser.add_argument("--dir", default=None)
    parser.add_argument(
        "--cold", action="store_true", help="drop the page cache before reopening (root only), as after a machine crash"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.gib, args.subjects)
        return
    out = Path(args.dir or Path(__file__).parent / "out")
    out.mkdir(parents=True, exist_ok=True)
    data_dir = Path(tempfile.mkdtemp(dir=out))
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--child",
                str(data_dir),
                "--gib",
                str(args.gib),
                "--subjects",
                str(args.subjects),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        line = proc.stdout.readline().split()
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        records, end = int(line[1]), int(line[2])
        if args.cold:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        started = time.perf_counter()
        store = LogStore(data_dir, CONFIG)
        elapsed = time.perf_counter() - started
        replayed = store.recovery.replayed
        store.close()
        cache = "cold" if args.cold else "warm"
        print(
            f"{cache} page cache: recovered {end / 1024**3:.2f} GiB ({records:,} records of 1 KiB, "
            f"{args.subjects} subjects, "
            f"{replayed:,} replayed after the checkpoint) in {elapsed:.2f} s "
            f"({end / 1e6 / elapsed:,.0f} MB/s, {replayed / elapsed:,.0f} records/s)"
        )
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
