"""A loop's first wait for durability while another thread's fsync round ends (qmq/store/flush.py
`Flusher.durable`): the round finishes after the wait saw its offset not durable and before the loop
was registered to be woken, so it wakes nobody there; the wait must still return, not hang until
some unrelated write comes. The interleaving is forced: the loop's registration runs that round."""

from __future__ import annotations

import asyncio
import threading

from qmq.store.store import LogStore, Message
from tests.support.stores import SMALL

WAIT_LIMIT_S = 10.0


class RoundDuringRegistration(dict):
    """The flusher's map of loops to wake: its first look-up lets another thread's blocking wait run
    a whole fsync round (`wait_durable`) that covers the offset the loop is about to wait for."""

    def __init__(self, flusher, offset: int) -> None:
        super().__init__()
        self.flusher, self.offset, self.rounds = flusher, offset, 0

    def get(self, key, default=None):
        if not self.rounds:
            self.rounds += 1
            other = threading.Thread(target=self.flusher.wait_durable, args=(self.offset,))
            other.start()
            other.join()
        return super().get(key, default)


def test_a_first_wait_covered_by_a_round_that_ended_meanwhile_returns(tmp_path) -> None:
    with LogStore(tmp_path / "store", SMALL) as store:
        flusher = store.flusher
        [appended] = store.append([Message("orders", "m1", b"x")])
        flusher._loops = RoundDuringRegistration(flusher, appended.end)

        async def scenario() -> None:
            await asyncio.wait_for(store.durable(appended.end), WAIT_LIMIT_S)

        asyncio.run(scenario())
        assert flusher._loops.rounds == 1 and store.durable_offset >= appended.end
