"""Message ids (qmq/ids.py): RFC 9562 UUIDv7 text, the creation time in the first 48 bits, strictly
increasing within one process, also past 4,096 ids in one millisecond."""

from __future__ import annotations

import time
import uuid

from qmq import ids
from qmq.ids import id_time_ms, new_id


def assert_v7(text: str) -> uuid.UUID:
    value = uuid.UUID(text)
    assert str(value) == text and value.version == 7 and value.variant == uuid.RFC_4122
    return value


def test_ids_are_uuid7_with_their_creation_time_and_increase() -> None:
    before = time.time_ns() // 1_000_000
    made = [new_id() for _ in range(20_000)]
    after = time.time_ns() // 1_000_000
    for text in made[::997] + made[-1:]:
        assert_v7(text)
        assert before <= id_time_ms(text) <= after
    assert made == sorted(made) and len(set(made)) == len(made)


def test_more_than_4096_ids_in_one_millisecond_borrow_the_next_and_keep_increasing(monkeypatch) -> None:
    frozen_ms = time.time_ns() // 1_000_000 + 10_000  # ahead of any id made so far in this process
    for name in ("_last_ms", "_counter", "_prefix"):  # put back afterwards: later ids of this process
        monkeypatch.setattr(ids, name, getattr(ids, name))  # must not carry the future time
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen_ms * 1_000_000)
    made = [new_id() for _ in range(9_000)]
    assert made == sorted(made) and len(set(made)) == len(made)
    times = [id_time_ms(t) for t in made]
    # the first millisecond takes 2,049 - 4,096 (its counter starts at random below 2,048), the next 4,096
    assert times[0] == frozen_ms and times[-1] == frozen_ms + 2 and times == sorted(times)
    for text in made[::1_000] + made[-1:]:
        assert_v7(text)
