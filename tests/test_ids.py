"""Message ids (qmq/ids.py, compiled from qmq/_ids.pyx): RFC 9562 UUIDv7 text, the creation time in
the first 48 bits, strictly increasing within one process, also past 4,096 ids in one millisecond;
a forked child's ids are its own."""

from __future__ import annotations

import os
import time
import uuid

import pytest

from qmq import ids
from qmq.ids import id_time_ms, new_id, new_id_py


def assert_v7(text: str) -> uuid.UUID:
    value = uuid.UUID(text)
    assert str(value) == text and value.version == 7 and value.variant == uuid.RFC_4122
    return value


def test_the_compiled_ids_are_built_and_used() -> None:
    assert ids.compiled is not None and new_id is ids.compiled.new_id  # scripts/setup.sh builds it


@pytest.mark.parametrize("make", [new_id, new_id_py], ids=["compiled", "python"])
def test_ids_are_uuid7_with_their_creation_time_and_increase(make) -> None:
    before = time.time_ns() // 1_000_000
    made = [make() for _ in range(20_000)]
    after = time.time_ns() // 1_000_000
    for text in made[::997] + made[-1:]:
        assert_v7(text)
        # more than 4,096 ids in a millisecond (the compiled version makes them that fast) borrow the
        # next one: ids may run ahead of the clock by one millisecond per 4,096
        assert before <= id_time_ms(text) <= after + len(made) // 4096 + 1
    assert made == sorted(made) and len(set(made)) == len(made)


def test_more_than_4096_ids_in_one_millisecond_borrow_the_next_and_keep_increasing(monkeypatch) -> None:
    frozen_ms = time.time_ns() // 1_000_000 + 10_000  # ahead of any id made so far in this process
    for name in ("_last_ms", "_counter", "_prefix"):  # put back afterwards: later ids of this process
        monkeypatch.setattr(ids, name, getattr(ids, name))  # must not carry the future time
    monkeypatch.setattr(ids.time, "time_ns", lambda: frozen_ms * 1_000_000)
    assert_borrows([new_id_py() for _ in range(9_000)], frozen_ms)


def test_the_compiled_ids_borrow_the_same_way() -> None:
    frozen_ms = time.time_ns() // 1_000_000 + 10_000
    saved = ids.compiled.state()
    try:
        made = [ids.compiled.new_id_at(frozen_ms) for _ in range(9_000)]
    finally:
        ids.compiled.restore(*saved)  # later ids of this process must not carry the future time
    assert_borrows(made, frozen_ms)


def test_a_forked_child_makes_ids_of_its_own() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next id, to the parent
        os.write(write, new_id().encode())
        os._exit(0)
    os.close(write)
    mine = new_id()
    with os.fdopen(read) as pipe:
        theirs = pipe.read()
    os.waitpid(pid, 0)
    assert_v7(theirs)
    assert mine[24:] != theirs[24:]  # the random part: not the same sequence in both processes


def assert_borrows(made: list[str], frozen_ms: int) -> None:
    assert made == sorted(made) and len(set(made)) == len(made)
    times = [id_time_ms(t) for t in made]
    # the first millisecond takes 2,049 - 4,096 (its counter starts at random below 2,048), the next 4,096
    assert times[0] == frozen_ms and times[-1] == frozen_ms + 2 and times == sorted(times)
    for text in made[::1_000] + made[-1:]:
        assert_v7(text)
