"""The in-memory hash wheel: the messages of the loaded buckets, by 500 ms tick.

The wheel's slots are hashed by absolute tick number (`due_ms // TICK_MS`), so a loaded window of
any length, overdue ticks after a restart and a clock shifted by months all work the same way; a
heap of the occupied ticks says which comes next. A slot is an `array('q')` of 8-byte references
(`ref(bucket slot, position in the bucket's .log file)`): no Python object per message. Nothing here
does I/O.
"""

from __future__ import annotations

import heapq
from array import array
from collections.abc import Iterable

TICK_MS = 500
POSITION_BITS = 40  # a bucket's .log file may hold up to 1 TiB
POSITION_MASK = (1 << POSITION_BITS) - 1
MAX_BUCKET_SLOTS = 1 << 22  # loaded buckets at once (a reference is a signed 64-bit int)


def ref(bucket_slot: int, position: int) -> int:
    return (bucket_slot << POSITION_BITS) | position


def split_ref(value: int) -> tuple[int, int]:
    return value >> POSITION_BITS, value & POSITION_MASK


def tick_of(due_ms: int) -> int:
    """The tick whose slot holds a message due at `due_ms`; it is taken out when the tick begins."""
    return due_ms // TICK_MS


class Wheel:
    def __init__(self) -> None:
        self._slots: dict[int, array] = {}
        self._ticks: list[int] = []  # heap of the ticks in _slots
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, tick: int, value: int) -> None:
        slot = self._slots.get(tick)
        if slot is None:
            self._slots[tick] = slot = array("q")
            heapq.heappush(self._ticks, tick)
        slot.append(value)
        self._count += 1

    def add_many(self, tick: int, values: Iterable[int]) -> None:
        slot = self._slots.get(tick)
        if slot is None:
            self._slots[tick] = slot = array("q")
            heapq.heappush(self._ticks, tick)
        before = len(slot)
        slot.extend(values)
        self._count += len(slot) - before

    def next_tick(self) -> int | None:
        return self._ticks[0] if self._ticks else None

    def take_due(self, now_tick: int, limit: int | None = None) -> list[array]:
        """Remove and return the references of every tick up to and including `now_tick`, earliest
        tick first; with `limit`, at most that many: the rest of a tick cut short stays in its slot
        (which of a tick's references go first is not promised)."""
        out = []
        ticks = self._ticks
        room = limit
        while ticks and ticks[0] <= now_tick and (room is None or room > 0):
            slot = self._slots[ticks[0]]
            if room is not None and len(slot) > room:
                out.append(slot[-room:])  # from the end: no move of the rest
                del slot[-room:]
                self._count -= room
                break
            del self._slots[heapq.heappop(ticks)]
            self._count -= len(slot)
            out.append(slot)
            if room is not None:
                room -= len(slot)
        return out

    def due_count(self, now_tick: int) -> int:
        """References of the ticks up to and including `now_tick` (due, not taken yet)."""
        return sum(len(slot) for tick, slot in self._slots.items() if tick <= now_tick)

    def nbytes(self) -> int:
        """Bytes held by the slots' buffers (what the wheel costs beyond its dict and heap)."""
        return sum(slot.buffer_info()[1] * slot.itemsize for slot in self._slots.values())
