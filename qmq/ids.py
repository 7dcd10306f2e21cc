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

from qmq.compiled import load

_COUNTER_BITS = 12  # rand_a, used as a counter within one millisecond
_VARIANT = 0b10 << 62  # RFC 9562's variant bits, above rand_b
_lock = threading.Lock()
_last_ms = 0
_counter = 0
_prefix = ""  # the id's text up to its counter for _last_ms: "tttttttt-tttt-7"
# Random bits from a generator seeded by the OS (and re-seeded in a forked child, so parent and child
# never share a sequence): an os.urandom() call per id costs more than the rest of making it.
_random = random.Random(os.urandom(16))
os.register_at_fork(after_in_child=lambda: _random.seed(os.urandom(16)))


def _time_prefix(ms: int) -> str:
    t = f"{ms:012x}"
    return f"{t[:8]}-{t[8:]}-7"


def new_id_py() -> str:
    """`new_id` in Python, the reference for qmq/_ids.pyx. (The text of the millisecond is kept, not
    formatted again for each id of it.)"""
    global _last_ms, _counter, _prefix
    with _lock:
        ms = time.time_ns() // 1_000_000
        if ms > _last_ms:
            _last_ms, _counter, _prefix = ms, _random.getrandbits(11), _time_prefix(ms)  # room to count up
        else:
            _counter += 1
            if _counter >> _COUNTER_BITS:  # 4096 ids in one millisecond: borrow the next one
                _last_ms, _counter = _last_ms + 1, 0
                _prefix = _time_prefix(_last_ms)
        prefix, counter = _prefix, _counter
        rand_b = _random.getrandbits(62)
    tail = "%016x" % (_VARIANT | rand_b)
    return f"{prefix}{counter:03x}-{tail[:4]}-{tail[4:]}"


compiled = load("qmq._ids")
if compiled is not None:
    compiled.seed(int.from_bytes(os.urandom(8), "big"))
    os.register_at_fork(after_in_child=lambda: compiled.seed(int.from_bytes(os.urandom(8), "big")))
    new_id = compiled.new_id
else:
    new_id = new_id_py


def id_time_ms(message_id: str) -> int | None:
    """The creation time (ms since the epoch) of a UUIDv7 id, or None for an id of another kind."""
    try:
        value = uuid.UUID(message_id)
    except ValueError:
        return None
    return value.int >> 80 if value.version == 7 else None
