"""How much a worker may pull: credit from free capacity, so that a worker never holds messages it
cannot start soon (Celery's prefetch starvation, where long tasks sit on reserved short ones).

The worker holds at most `free slots x prefetch multiplier` messages that have not started, where
the free slots are those not running a handler: with every slot busy on long handlers it holds none
back from the rest of the group. A pull asks for the credit left after what is queued and what
pulls in flight already asked for. With several consumers, one pull asks for at most its share of
the window (the window divided by the consumers, rounded down), so every consumer of an idle worker
can keep a long poll open at once: a quiet subject's poll never keeps another consumer from
pulling (and so from seeing its retries come due). Small credit waits for a pull's worth (half the
window, or a share when that is less), so a busy worker pulls in batches, while an idle worker
pulls even one. Feeders get credit in the order they asked for it: one whose pull just came back
never overtakes one already waiting, so none starves even when the window is smaller than the
number of consumers.
"""

from __future__ import annotations

import threading
from collections import deque


class Capacity:
    def __init__(self, concurrency: int, prefetch_multiplier: int, consumers: int = 1) -> None:
        if concurrency < 1 or prefetch_multiplier < 1:
            raise ValueError("concurrency and the prefetch multiplier must be at least 1")
        self.concurrency = concurrency
        self.multiplier = prefetch_multiplier
        self.window = concurrency * prefetch_multiplier
        self.share = max(1, self.window // max(1, consumers))
        self.worth = min(self.share, max(1, self.window // 2))  # credit worth a pull while some is held
        self.running = 0  # handlers executing
        self.queued = 0  # pulled, waiting for a slot
        self.reserved = 0  # asked for by pulls in flight
        self.stopped = False
        self._cond = threading.Condition()
        self._waiting: deque[object] = deque()  # feeders waiting in reserve(), first come first served

    def credit(self) -> int:
        return (self.concurrency - self.running) * self.multiplier - self.queued - self.reserved

    def reserve(self, timeout_s: float) -> int:
        """Wait until a pull is worth making and it is this caller's turn (or `timeout_s`, or `stop`);
        returns how many messages it may ask for, 0 for none, and counts them as asked for until
        `received`."""
        with self._cond:
            turn = object()
            self._waiting.append(turn)
            try:
                ready = self._cond.wait_for(
                    lambda: self.stopped or (self._waiting[0] is turn and self._pull_allowed()), timeout_s
                )
            finally:
                self._waiting.remove(turn)
                self._cond.notify_all()  # the next in line may go now
            if not ready or self.stopped:
                return 0
            take = min(self.credit(), self.share)
            self.reserved += take
            return take

    def _pull_allowed(self) -> bool:
        credit = self.credit()
        return credit >= self.worth or (credit >= 1 and self.queued + self.reserved == 0)

    def received(self, reserved: int, count: int) -> None:
        """A pull that asked for `reserved` brought `count` messages."""
        with self._cond:
            self.reserved -= reserved
            self.queued += count
            self._cond.notify_all()

    def dropped(self, count: int) -> None:
        """Pulled messages this worker will not run (an ordered queue handed out again, or parked)."""
        with self._cond:
            self.queued -= count
            self._cond.notify_all()

    def started(self) -> None:
        with self._cond:
            self.queued -= 1
            self.running += 1

    def finished(self) -> None:
        with self._cond:
            self.running -= 1
            self._cond.notify_all()

    @property
    def held(self) -> int:
        """Messages this worker holds: queued or running."""
        return self.queued + self.running

    @property
    def waiting(self) -> int:
        """Feeders waiting for credit."""
        with self._cond:
            return len(self._waiting)

    def stop(self) -> None:
        with self._cond:
            self.stopped = True
            self._cond.notify_all()
