"""Message ids: UUIDv7 (RFC 9562), made by the producer before its transaction commits.

They sort by creation time, so the outbox, the broker ledger and the consumers' idempotency records
can be range-scanned by time, and they are the join key of the nightly reconciliation. Ids made in
one process are strictly increasing, even within one millisecond (RFC 9562 method 3: the random
part after the timestamp is a counter seeded at random each millisecond).
"""

from __future__ import annotations

import os
import random
import threading
import time
import uuid

_COUNTER_BITS = 12  # rand_a, used as a counter within one millisecond
_lock = threading.Lock()
_last_ms = 0
_counter = 0
# Random bits from a generator seeded by the OS (and re-seeded in a forked child, so parent and child
# never share a sequence): an os.urandom() call per id costs more than the rest of making it.
_random = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _random.seed(os.urandom(16)))


def new_id() -> str:
    """A new UUIDv7 as its canonical 36-character string."""
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter = ms, _random.getrandbits(11)  # leave room to count up
        else:
            _counter += 1
            if _counter >> _COUNTER_BITS:  # 4096 ids in one millisecond: borrow the next one
                _last_ms, _counter = _last_ms + 1, 0
            ms = _last_ms
        counter = _counter
        rand_b = _random.getrandbits(62)
    h = "%032x" % ((ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62) | rand_b)
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def id_time_ms(message_id: str) -> int | None:
    """The creation time (ms since the epoch) of a UUIDv7 id, or None for an id of another kind."""
    try:
        value = uuid.UUID(message_id)
    except ValueError:
        return None
    return value.int >> 80 if value.version == 7 else None
