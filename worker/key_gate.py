"""The gate of an ordered consumer (docs/ordering.md): one message of a key at a time, in the order
the queue handed them out, without I/O.

Deliveries come in per queue in consume-log order. The gate keeps a line per (queue, order key) and
lets out a key's next delivery only when the one before it is finished, so different keys (of one
queue too) run in parallel while a key's own messages never overlap or overtake each other. A
failing message keeps its key busy while it waits to be retried in place: its key waits, the others
go on. A key stopped behind a poison message (`on_poison="stop"`) lets nothing out; its deliveries
are handed back to be parked (dead-lettered behind it) until a re-driven message of the key
arrives. Not thread-safe: the ordered feeder holds a lock around it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from qmq.client import Delivery
from qmq.protocol.ordering import ORDER_KEY_HEADER, split_queue_subject

GateKey = tuple[int, str]  # (queue, order key)


def gate_key(delivery: Delivery) -> GateKey:
    """A delivery's queue and order key. A message without a key (sent to a queue subject directly)
    is a key of its own, its id."""
    split = split_queue_subject(delivery.subject)
    queue = split[1] if split is not None else -1
    return queue, delivery.headers.get(ORDER_KEY_HEADER) or f"id:{delivery.id}"


class KeyGate:
    def __init__(self) -> None:
        self._lines: dict[GateKey, deque[Delivery]] = {}
        self._busy: set[GateKey] = set()  # a delivery of the key is out (running, or waiting to retry)
        self._ready: set[GateKey] = set()  # not busy, with a delivery waiting
        self.stopped: dict[GateKey, str] = {}  # key -> the id of the poison message it stopped at

    def __len__(self) -> int:
        """Deliveries waiting (not out)."""
        return sum(len(line) for line in self._lines.values())

    def add(self, deliveries: Iterable[Delivery]) -> list[Delivery]:
        """Take pulled deliveries; returns those of stopped keys, to be parked (a re-driven message,
        from the retry subject, restarts its key instead)."""
        parked = []
        for delivery in deliveries:
            key = gate_key(delivery)
            if key in self.stopped:
                if not delivery.is_retry:
                    parked.append(delivery)
                    continue
                del self.stopped[key]  # an operator re-drove the key's dead letters: it goes on
            self._lines.setdefault(key, deque()).append(delivery)
            if key not in self._busy:
                self._ready.add(key)
        return parked

    def take(self, may_run: Callable[[int], bool]) -> list[Delivery]:
        """The next delivery of every key that is free, in a queue that `may_run`; each key is busy
        until `done`."""
        out = []
        for key in list(self._ready):
            if not may_run(key[0]):
                continue
            self._ready.discard(key)
            line = self._lines[key]
            out.append(line.popleft())
            if not line:
                del self._lines[key]
            self._busy.add(key)
        return out

    def put_back(self, delivery: Delivery) -> None:
        """A delivery let out but not started (its queue's lease was in doubt): first in line again."""
        key = gate_key(delivery)
        self._lines.setdefault(key, deque()).appendleft(delivery)
        self._busy.discard(key)
        self._ready.add(key)

    def done(self, delivery: Delivery) -> None:
        """The key's delivery is finished: its next may go."""
        key = gate_key(delivery)
        self._busy.discard(key)
        if key in self._lines:
            self._ready.add(key)

    def stop(self, delivery: Delivery) -> list[Delivery]:
        """The key stops at its poison `delivery`: returns its waiting deliveries, to be parked."""
        key = gate_key(delivery)
        self._busy.discard(key)
        return self.stop_key(key, delivery.id)

    def stop_key(self, key: GateKey, poison_id: str) -> list[Delivery]:
        """Stop `key` (at `poison_id`, as the brokers remember it); returns its waiting deliveries, to
        be parked. A delivery of the key out now finishes first."""
        self.stopped[key] = poison_id
        self._ready.discard(key)
        return list(self._lines.pop(key, ()))

    def drop_queue(self, queue: int) -> list[Delivery]:
        """Forget the waiting deliveries of `queue` (its lease was handed anew: the broker hands them
        out again); those out stay busy until `done`."""
        dropped = []
        for key in [k for k in self._lines if k[0] == queue]:
            dropped.extend(self._lines.pop(key))
            self._ready.discard(key)
        return dropped

    def busy_queues(self) -> set[int]:
        """Queues with a delivery out or waiting."""
        return {k[0] for k in self._busy} | {k[0] for k in self._lines}
