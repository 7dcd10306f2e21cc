"""Parking: the undelivered messages of a subject that no broker group would take (every group of it
down, failing over or read-only) wait here together instead of each backing off on its own.

Why: a broker group's failover takes seconds (10 s by default). Messages backing off one by one (0.5 s
up to 30 s) would come late by up to that much again once it is over; trying each of them every second
instead would cost a send per message per second through a long outage. Here a subject is *probed*:
one batch of its parked messages is tried again after PROBE_BACKOFF_S, and the first message of the
subject a broker stores (a probe, or a message that came due meanwhile) releases them all at once. So
the messages of a subject are late by at most the outage plus the last probe interval, and an outage
costs one batch per subject per interval.

A message refused for itself (too large, say) while others of its subject are stored is not parked:
it backs off on its own (scheduler.py). Nothing here does I/O.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

PROBE_BACKOFF_S = (0.5, 1.0, 2.0)  # parked -> first probe, then after each failed probe; the last repeats


@dataclass
class ParkedSubject:
    probe_at_ms: int
    values: array = field(default_factory=lambda: array("q"))  # wheel references (wheel.ref)
    probes: int = 0  # sent since it was parked (each one's failure parks its messages again)


class Parking:
    def __init__(self) -> None:
        self.subjects: dict[str, ParkedSubject] = {}
        self.count = 0  # messages parked, probes out not counted

    def __len__(self) -> int:
        return self.count

    def park(self, subject: str, values: Iterable[int], now_ms: int) -> None:
        """None of `values` (messages of `subject`) was stored, and nothing of `subject` in the same
        delivery was: its brokers are out of reach."""
        parked = self.subjects.get(subject)
        if parked is None:
            parked = self.subjects[subject] = ParkedSubject(now_ms + _ms(PROBE_BACKOFF_S[0]))
        before = len(parked.values)
        parked.values.extend(values)
        self.count += len(parked.values) - before

    def release(self, subject: str) -> array | None:
        """A broker stored a message of `subject`: every message parked for it, to deliver now."""
        parked = self.subjects.pop(subject, None)
        if parked is None:
            return None
        self.count -= len(parked.values)
        return parked.values

    def due_probes(self, now_ms: int, size: int) -> list[array]:
        """For each subject whose probe is due, up to `size` of its messages to try again now. The next
        probe is set at once, whatever becomes of this one: a probe that never comes back (its
        messages cancelled meanwhile, a send that hangs) cannot stop the subject being probed."""
        probes = []
        for subject, parked in list(self.subjects.items()):
            if parked.probe_at_ms > now_ms:
                continue
            if not parked.values:  # its probe took the last of them and has not failed (yet)
                del self.subjects[subject]
                continue
            probe, parked.values = parked.values[:size], parked.values[size:]
            parked.probes += 1
            parked.probe_at_ms = now_ms + _ms(PROBE_BACKOFF_S[min(parked.probes, len(PROBE_BACKOFF_S) - 1)])
            self.count -= len(probe)
            probes.append(probe)
        return probes

    def next_probe_ms(self) -> int | None:
        due = [p.probe_at_ms for p in self.subjects.values() if p.values]
        return min(due) if due else None


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
