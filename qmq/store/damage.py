"""Damaged regions of the message log: where records fail their CRC (found by the scrub or by a
reader), which messages that hides, and whether a copy from another member of the group may still
mend it (docs/replication.md, "A damaged record").

A region is *awaiting* while the server may mend it from a group member (qmq/replication/mending.py):
readers stop at its messages instead of passing them. It is *lost* once no member gave a good copy in
time, or at once when the store is not in a replicated group: the broker then dead-letters its
messages, so every consumer group moves on and the loss is visible (issue 19). A mended region is
forgotten. Nothing here does I/O; `LogStore` holds one `Damage` and calls it under its lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

MEND_GIVE_UP_S = 10.0  # no member gave a good copy in this long: the region's messages are lost
MEND_RETRY_S = 1.0  # between attempts at one region


@dataclass
class DamagedRegion:
    start: int  # log offsets: the damaged record's first byte ...
    end: int  # ... and where readable records resume (or its segment ends)
    path: str  # the segment file
    reason: str
    found_at: float = field(default_factory=time.monotonic)
    lost: bool = False
    tries: int = 0
    next_try: float = 0.0

    def where(self) -> str:
        return f"{self.path} offset {self.start}"


class Damage:
    def __init__(self) -> None:
        self.regions: dict[int, DamagedRegion] = {}  # by start offset
        self._mendable = False
        self.unreadable_at: dict[tuple[str, int], int] = {}  # (subject, seq) -> offset of its record
        self.mended = 0  # regions mended since open
        self.lost = 0  # regions given up since open

    @property
    def mendable(self) -> bool:
        """A group member may hold good copies (set by the replication roles)."""
        return self._mendable

    @mendable.setter
    def mendable(self, value: bool) -> None:
        """Turned on, it also revives the regions given up before it was known (found at open)."""
        if value and not self._mendable:
            for region in self.regions.values():
                if region.lost and region.tries == 0:
                    region.lost = False
                    self.lost -= 1
        self._mendable = value

    def add(self, start: int, end: int, path: str, reason: str) -> DamagedRegion:
        """Note a region (once: the region already noted for `start` is returned)."""
        region = self.covering(start)
        if region is None:
            region = DamagedRegion(start, max(end, start + 1), path, reason, lost=not self._mendable)
            self.regions[start] = region
            if region.lost:
                self.lost += 1
        return region

    def covering(self, offset: int) -> DamagedRegion | None:
        for region in self.regions.values():
            if region.start <= offset < region.end:
                return region
        return None

    @property
    def pending(self) -> int:
        """Regions still to be mended."""
        return sum(1 for r in self.regions.values() if not r.lost)

    def awaiting(self, now: float) -> list[DamagedRegion]:
        """Regions still to be mended whose next attempt is due."""
        return [r for r in self.regions.values() if not r.lost and r.next_try <= now]

    def failed_attempt(self, region: DamagedRegion, now: float) -> None:
        region.tries += 1
        region.next_try = now + MEND_RETRY_S

    def lose(self, region: DamagedRegion) -> list[tuple[str, int]]:
        """Give `region` up; returns the (subject, seq) of the messages it hides, as far as known."""
        if not region.lost:
            region.lost = True
            self.lost += 1
        return self.hidden_by(region)

    def mend(self, region: DamagedRegion) -> list[tuple[str, int]]:
        """`region` holds good records again: forget it and the messages it hid (returned)."""
        self.regions.pop(region.start, None)
        self.mended += 1
        hidden = self.hidden_by(region)
        for key in hidden:
            del self.unreadable_at[key]
        return hidden

    def hidden_by(self, region: DamagedRegion) -> list[tuple[str, int]]:
        return [key for key, offset in self.unreadable_at.items() if region.start <= offset < region.end]

    def held_back(self, subject: str, start: int, end: int) -> int | None:
        """The first sequence of `subject` in [start, end) that cannot be read now but may still be
        mended: a reader stops there rather than pass it."""
        held = [
            seq
            for (s, seq), offset in self.unreadable_at.items()
            if s == subject and start <= seq < end and (r := self.covering(offset)) is not None and not r.lost
        ]
        return min(held) if held else None
