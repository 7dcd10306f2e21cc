"""Which member of a replicated group to export the ledger from: the `reconcile` service of
docker-compose.yml runs this in its container (qmq's image) with the stores of one group's members
and passes what it prints to `qmq ledger export --data-dir`.

    python scripts/compose-longest-log.py /stores/broker-a /stores/broker-a-replica

Every member holds the same records at the same offsets (docs/replication.md), so one member's store
is the group's whole history, and exporting two would count each message, delivery and ack twice.
The one to export is the member with the newest master epoch (`<store>/epochs`, its last line) and,
among those, the longest message log (the last segment's base offset plus its size): after a
failover that is the promoted replica (or the old master once it caught up again), never a deposed
master whose log ends, however long it is, where its epoch ended. Ties go to the first named (the
original master). Members whose directory holds no store yet (a volume never used) are skipped;
exit 1 when none does.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qmq.store import epochs
from qmq.store.segment import list_segments
from qmq.store.verify import message_log_dir


def position(store: Path) -> tuple[int, int]:
    """(last master epoch, message log end) of a store; FileNotFoundError when it is not one."""
    segments = list_segments(message_log_dir(store))
    end = segments[-1][0] + segments[-1][1].stat().st_size if segments else 0
    return epochs.last_epoch(epochs.load(store)), end


def main(stores: list[str]) -> int:
    if not stores:
        print("usage: compose-longest-log.py STORE [STORE ...]", file=sys.stderr)
        return 2
    best: tuple[tuple[int, int], str] | None = None
    for store in stores:
        try:
            found = position(Path(store))
        except (FileNotFoundError, ValueError) as exc:
            print(f"compose-longest-log: {store} skipped: {exc}", file=sys.stderr)
            continue
        print(f"compose-longest-log: {store}: epoch {found[0]}, log end {found[1]}", file=sys.stderr)
        if best is None or found > best[0]:
            best = (found, store)
    if best is None:
        print(f"compose-longest-log: no store among {' '.join(stores)}", file=sys.stderr)
        return 1
    print(best[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
