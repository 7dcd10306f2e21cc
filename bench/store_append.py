"""Log-store append throughput: 1 KiB records in batches of 64, 1 and 100 subjects, sync and async flush.

Mirrors how the broker uses the store: one asyncio loop appends each incoming batch and awaits its
durability while other batches keep arriving (`--inflight` producers), so with sync flush one fsync
covers every batch that arrived meanwhile (group commit). A record counts once it is acknowledged:
durable for sync, appended for async. Prints one line per case; record figures in docs/benchmarks.md.

    .venv/bin/python bench/store_append.py                      # the matrix
    .venv/bin/python bench/store_append.py --flush sync --subjects 1 --records 500000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

from qmq.store.flush import FlushMode
from qmq.store.store import LogStore, Message, StoreConfig


async def run_case(
    data_dir: Path, flush: str, subjects: int, records: int, batch: int, size: int, inflight: int
) -> dict:
    store = LogStore(data_dir, StoreConfig(flush=FlushMode(flush), background=False))
    payload = os.urandom(size)
    batches = [
        [
            Message(f"bench.subject-{(b * batch + i) % subjects}", f"01JDX7Q3ZP4Y8N2K5M{b:08d}{i:03d}", payload)
            for i in range(batch)
        ]
        for b in range(records // batch)
    ]
    next_batch = iter(batches)
    latencies: list[float] = []

    async def producer() -> None:
        for messages in next_batch:
            started = time.perf_counter()
            results = store.append(messages)
            await store.durable(results[-1].end)
            latencies.append(time.perf_counter() - started)

    syncs_before = store.flusher.syncs
    started = time.perf_counter()
    await asyncio.gather(*(producer() for _ in range(inflight)))
    elapsed = time.perf_counter() - started
    syncs = store.flusher.syncs - syncs_before
    store.close()
    latencies.sort()
    done = len(batches) * batch
    return {
        "flush": flush,
        "subjects": subjects,
        "records": done,
        "seconds": elapsed,
        "rate": done / elapsed,
        "mb_s": done * size / elapsed / 1e6,
        "fsyncs": syncs,
        "p50_ms": latencies[len(latencies) // 2] * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flush", choices=["sync", "async"], action="append")
    parser.add_argument("--subjects", type=int, action="append")
    parser.add_argument("--records", type=int, default=320_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--size", type=int, default=1024, help="payload bytes per record")
    parser.add_argument("--inflight", type=int, default=16, help="batches awaiting durability at once")
    parser.add_argument("--dir", default=None, help="where to write (default: a temp dir under bench/out)")
    args = parser.parse_args()
    out = Path(args.dir or Path(__file__).parent / "out")
    out.mkdir(parents=True, exist_ok=True)
    print(
        f"# {platform.node()} {os.cpu_count()} cores, Python {platform.python_version()}, "
        f"{args.size} B payload, batches of {args.batch}, {args.inflight} in flight, dir {out}"
    )
    print(
        f"{'flush':6} {'subjects':>8} {'records':>9} {'records/s':>10} {'MB/s':>7} {'fsyncs':>7} "
        f"{'p50 ms':>7} {'p99 ms':>7}"
    )
    for flush in args.flush or ["sync", "async"]:
        for subjects in args.subjects or [1, 100]:
            data_dir = Path(tempfile.mkdtemp(dir=out))
            try:
                r = asyncio.run(run_case(data_dir, flush, subjects, args.records, args.batch, args.size, args.inflight))
            finally:
                shutil.rmtree(data_dir, ignore_errors=True)
            print(
                f"{r['flush']:6} {r['subjects']:>8} {r['records']:>9} {r['rate']:>10,.0f} {r['mb_s']:>7.0f} "
                f"{r['fsyncs']:>7} {r['p50_ms']:>7.1f} {r['p99_ms']:>7.1f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
