"""Frames on their way to one asyncio stream, shared by the servers' and the asyncio client's
connections.

Small frames queued in one loop iteration go out in one write at its end: pipelined requests or
replies finished together cost one system call, not one each. A frame of COALESCE_BELOW_BYTES or
more goes out at once, behind whatever was queued before it (order is kept): its own size already
pays for the system call, and holding it to the end of the iteration leaves the peer idle while
this loop runs its other ready tasks. A producer with 8 sends of 64 messages in flight built its
next batches (about a millisecond each) before the batch it had finished went out: through the
client, 52,100 against 57,400 msg/s produced, alternated on one machine (docs/benchmarks.md). On a
server's side (pull and fetch replies) the same rule measured no different from before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

COALESCE_BELOW_BYTES = 16 * 1024  # smaller frames wait for the end of the loop iteration


class FrameQueue:
    """What to write to one stream, in order. `write` hands bytes to the transport; `closed` says
    that nothing more may be written (what is queued then is dropped)."""

    __slots__ = ("_closed", "_frames", "_write")

    def __init__(self, write: Callable[[bytes], object], closed: Callable[[], bool]) -> None:
        self._write = write
        self._closed = closed
        self._frames: list[bytes] = []

    def put(self, frame: bytes) -> None:
        """Send `frame` after every frame put before it: now if it is large, else at the end of
        this loop iteration together with the other small ones."""
        if len(frame) >= COALESCE_BELOW_BYTES:
            self._frames.append(frame)
            self.flush()
            return
        if not self._frames:
            asyncio.get_running_loop().call_soon(self.flush)
        self._frames.append(frame)

    def flush(self) -> None:
        """Write what is queued now (a frame that must not wait, or the end of the iteration)."""
        frames = self._frames
        if frames and not self._closed():
            self._write(b"".join(frames) if len(frames) > 1 else frames[0])
        frames.clear()
