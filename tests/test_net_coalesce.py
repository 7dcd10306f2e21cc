"""`FrameQueue` (qmq/net/coalesce.py): small frames of one loop iteration share one write at its
end; a large frame goes out at once, behind those queued before it; nothing after the stream closed."""

from __future__ import annotations

import asyncio

from qmq.net.coalesce import COALESCE_BELOW_BYTES, FrameQueue

SMALL = b"s" * 100
LARGE = b"L" * COALESCE_BELOW_BYTES


def run(body) -> list[bytes]:
    writes: list[bytes] = []
    closed = {"now": False}

    async def main() -> None:
        queue = FrameQueue(writes.append, lambda: closed["now"])
        await body(queue, writes, closed)

    asyncio.run(main())
    return writes


def test_small_frames_of_one_iteration_share_one_write_at_its_end() -> None:
    async def body(queue, writes, closed) -> None:
        queue.put(SMALL)
        queue.put(b"t" * 10)
        assert writes == []  # not before the iteration ends
        await asyncio.sleep(0)
        assert writes == [SMALL + b"t" * 10]
        queue.put(SMALL)
        await asyncio.sleep(0)

    assert run(body) == [SMALL + b"t" * 10, SMALL]


def test_a_large_frame_goes_out_at_once_behind_the_small_ones_queued_before_it() -> None:
    async def body(queue, writes, closed) -> None:
        queue.put(SMALL)
        queue.put(LARGE)
        assert writes == [SMALL + LARGE]  # before put returned, in order
        queue.put(LARGE)
        assert writes == [SMALL + LARGE, LARGE]
        await asyncio.sleep(0)  # the end-of-iteration flush finds nothing left

    assert run(body) == [SMALL + LARGE, LARGE]


def test_nothing_is_written_once_the_stream_is_closed() -> None:
    async def body(queue, writes, closed) -> None:
        queue.put(SMALL)
        closed["now"] = True
        await asyncio.sleep(0)
        queue.put(LARGE)
        queue.flush()

    assert run(body) == []
