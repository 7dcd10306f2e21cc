"""Parking: the undelivered messages of a subject that no broker group would take (every group of it
down, failing over or read-only) wait here together instead of each backing off on its own.

Why: a broker group's failover takes seconds (10 s by default). Messages backing off one by one (0.5 s
up to 30 s) would come late by up to that much again once it is over; trying each of them every two
seconds instead would cost a send per message every two seconds through a long outage. Here a subject
is *probed*: a few of its parked messages (PROBE_MESSAGES) are tried again after PROBE_BACKOFF_S, and
the first message of the subject a broker stores (a probe, or a message that came due meanwhile)
releases them all. So the messages of a subject are late by at most the outage plus the last probe
interval, and an outage costs a few sends per subject per interval.

Released backlogs go back to the wheel RELEASE_PER_TICK messages per tick, all subjects together (the
scheduler reads each tick's messages on its event loop, which must keep answering: after a meta
server's outage every subject may be released at once). They wait here until their tick, and each
tick's room is shared evenly among the subjects releasing (`due_released`, round robin): a small
subject released behind a large backlog goes in the first tick with room, not after the backlog. A
subject parked again by a send that began after its release went and no later than REPARK_WINDOW_S
after its last tick (its brokers take a few messages, not the backlog: big batches time out, say)
takes back what its release has not sent yet (it would meet the same brokers) and has its next
release put off by RELEASE_BACKOFF_S, growing each time, so a flapping subject costs no more than
each message's own backoff did; a send that began before the release, or while it waited for its
first tick, says nothing of it. A message refused for itself (too large, say) while others of its
subject are stored is not parked: it backs off on its own (scheduler.py). Nothing here does I/O.
"""

from __future__ import annotations

import heapq
import itertools
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from delay_server.wheel import TICK_MS

PROBE_BACKOFF_S = (0.5, 1.0, 2.0)  # parked -> first probe, then after each probe; the last repeats
PROBE_MESSAGES = 8  # tried in one probe: one stored releases the rest
REPARK_WINDOW_S = 5.0  # a failed send begun within this of a release's last tick: the release came too soon
RELEASE_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)  # after the n-th release too soon in a row; the last repeats
RELEASE_PER_TICK = 8192  # released messages per wheel tick (500 ms), all subjects together: about 16,000 a second
STATS_SUBJECTS = 20  # subjects named in the stats, those with the most parked first
# A subject whose probe took its last parked messages is forgotten this long after its next probe was
# due with nothing to send: longer than any send waits for its answer, so a probe that failed has come
# back and parked its messages again by then; one that never comes back (its messages cancelled) left
# an empty entry, which would otherwise stay until the subject's next message.
EMPTY_KEPT_S = 60.0


@dataclass
class ParkedSubject:
    probe_at_ms: int
    values: array = field(default_factory=lambda: array("q"))  # wheel references (wheel.ref)
    probes: int = 0  # sent since it was parked (each one's failure parks its messages again)
    streak: int = 0  # releases in a row that came too soon (REPARK_WINDOW_S)


@dataclass
class Release:
    at_ms: int  # its messages go from here (from its first tick's start, once it has begun)
    until_ms: int  # its last tick goes here (so far, while it goes)
    streak: int  # of the subject when it was released


@dataclass
class Releasing:
    """A released backlog on its way back to the wheel."""

    at_tick: int  # none of it goes before this tick
    values: array
    release: Release  # its `until_ms` moves with each tick it goes in
    sent: int = 0  # values[:sent] went to the wheel, oldest first


class Parking:
    def __init__(self) -> None:
        self.subjects: dict[str, ParkedSubject] = {}
        self.count = 0  # messages parked, probes out not counted
        self._released: dict[str, Release] = {}  # subject -> its last release
        self._kept_after_prune = 0
        self.releasing: dict[str, Releasing] = {}  # backlogs going back to the wheel
        self.releasing_count = 0  # their messages not yet in the wheel
        # Of those, the subjects whose first tick came, each with its turn (the smallest is served next:
        # a subject's turn is when it was released, or last served), and a heap of the others by first
        # tick (an entry whose release is no longer in `releasing` is skipped): so a pass of the
        # scheduler's fire loop costs what it hands out, not a look at every release put off.
        self._begun: dict[str, int] = {}
        self._starting: list[tuple[int, int, str, Releasing]] = []
        self._turns = itertools.count()
        # When each parked subject's probe is due, and when an empty one is forgotten: heaps of
        # (time, n, subject, its entry, the probe time it was set for); an entry no longer parked, or
        # whose probe time moved since, is skipped. So a pass costs the probes due, not every subject.
        self._probes: list[tuple[int, int, str, ParkedSubject, int]] = []
        self._forgets: list[tuple[int, int, str, ParkedSubject, int]] = []
        self._tick = -1  # the tick of `_tick_used`
        self._tick_used = 0  # released messages put into the wheel in that tick

    def __len__(self) -> int:
        return self.count

    def park(self, subject: str, values: Iterable[int], now_ms: int, sent_ms: int) -> int | None:
        """None of `values` (messages of `subject`, in a send begun at `sent_ms`) was stored, and
        nothing of `subject` in the same delivery was: its brokers are out of reach. Returns None if
        the subject was parked already, else how many of its releases in a row came too soon (0: the
        first time in a while)."""
        parked = self.subjects.get(subject)
        going = self.releasing.get(subject)
        # A send begun once its release had begun going tells of the release (it came too soon); one
        # begun before, or while the release waits for its first tick, tells nothing of it.
        verdict = going is not None and going.sent > 0 and sent_ms >= going.release.at_ms
        streak = None
        if parked is None:
            last = self._released.get(subject)
            if last is None or sent_ms > last.until_ms + _ms(REPARK_WINDOW_S):
                streak = 0  # a new outage
            elif sent_ms >= last.at_ms and (going is None or verdict):
                streak = last.streak + 1  # the release came too soon
            else:
                streak = last.streak  # a send begun before the release: it tells nothing of it
            parked = self.subjects[subject] = ParkedSubject(now_ms + _ms(PROBE_BACKOFF_S[0]), streak=streak)
        before = len(parked.values)
        if not before:  # (again) something to probe: its probe time may have passed while it was empty
            self._push(self._probes, parked.probe_at_ms, subject, parked)
        parked.values.extend(values)
        if verdict:  # what its release had not sent yet would meet the same brokers: parked with them
            parked.values.extend(self._stop_releasing(subject))
        self.count += len(parked.values) - before
        return streak

    def _stop_releasing(self, subject: str) -> array:
        """What is left of `subject`'s release, taken back (it is parked again)."""
        going = self.releasing.pop(subject, None)
        self._begun.pop(subject, None)
        if going is None:
            return array("q")
        rest = going.values[going.sent :]
        self.releasing_count -= len(rest)
        return rest

    def release(self, subject: str, now_ms: int) -> int | None:
        """A broker stored a message of `subject`: every message parked for it goes back to the wheel
        (`due_released`), from now unless its last releases came too soon. Returns how many, or None
        when it was not parked."""
        parked = self.subjects.pop(subject, None)
        if parked is None:
            return None
        self.count -= len(parked.values)
        delay_ms = _ms(RELEASE_BACKOFF_S[min(parked.streak, len(RELEASE_BACKOFF_S)) - 1]) if parked.streak else 0
        at_ms = now_ms + delay_ms
        self.releasing_count += len(parked.values)
        going = self.releasing.get(subject)
        if going is not None:  # parked by a send that said nothing of its release, which goes on
            going.values.extend(parked.values)
            return len(parked.values)
        release = Release(at_ms, at_ms, parked.streak)
        if parked.values:
            going = self.releasing[subject] = Releasing(at_ms // TICK_MS, parked.values, release)
            heapq.heappush(self._starting, (going.at_tick, next(self._turns), subject, going))
        self._forget_old_releases(now_ms)
        self._released[subject] = release
        return len(parked.values)

    def due_released(self, now_ms: int) -> list[array]:
        """Released messages to put into the wheel's tick of `now_ms` now: what is left of the tick's
        RELEASE_PER_TICK, shared evenly among the subjects whose release has begun, round robin (a
        subject served goes to the back), each subject's oldest first."""
        tick = now_ms // TICK_MS
        if tick > self._tick:  # (a clock stepped back stays within the later tick's room)
            self._tick, self._tick_used = tick, 0
        room = RELEASE_PER_TICK - self._tick_used
        out: list[array] = []
        self._admit(tick)
        while room > 0 and self._begun:
            begun = sorted(self._begun, key=self._begun.__getitem__)
            share = max(1, room // len(begun))
            for subject in begun[:room]:
                going = self.releasing[subject]
                del self._begun[subject]
                if not going.sent:  # behind a full tick, it begins later than released
                    going.release.at_ms = max(going.release.at_ms, tick * TICK_MS)
                take = min(share, len(going.values) - going.sent)
                out.append(going.values[going.sent : going.sent + take])
                going.sent += take
                room -= take
                self.releasing_count -= take
                going.release.until_ms = max(going.release.until_ms, tick * TICK_MS)
                if going.sent < len(going.values):
                    self._begun[subject] = next(self._turns)  # to the back
                else:
                    del self.releasing[subject]
        self._tick_used = RELEASE_PER_TICK - room
        return out

    def _admit(self, tick: int) -> None:
        """The releases whose first tick is `tick` or before join those served (for good: a clock
        stepped back later does not stop a release that has begun)."""
        starting = self._starting
        while starting and starting[0][0] <= tick:
            _, turn, subject, going = heapq.heappop(starting)
            if self.releasing.get(subject) is going:
                self._begun[subject] = turn

    def next_release_ms(self, now_ms: int) -> int | None:
        """When `due_released` has something next: `now_ms` if a release has begun and this tick has
        room left, the next tick if its room is used up, else the first tick of a release put off;
        None when nothing is releasing."""
        if not self.releasing:
            return None
        tick = now_ms // TICK_MS
        self._admit(tick)
        if self._begun:  # room again after the tick whose room is used up (a clock stepped back: after that one)
            return (self._tick + 1) * TICK_MS if tick <= self._tick and self._tick_used >= RELEASE_PER_TICK else now_ms
        starting = self._starting
        while starting and self.releasing.get(starting[0][2]) is not starting[0][3]:
            heapq.heappop(starting)  # taken back since
        return starting[0][0] * TICK_MS if starting else None

    def _forget_old_releases(self, now_ms: int) -> None:
        """Drop the releases too old to matter, once their number doubled since the last time (so a
        burst of releases costs a constant time each)."""
        if len(self._released) > 2 * self._kept_after_prune + 1024:
            oldest = now_ms - _ms(REPARK_WINDOW_S)
            self._released = {s: r for s, r in self._released.items() if r.until_ms >= oldest or s in self.releasing}
            self._kept_after_prune = len(self._released)

    def due_probes(self, now_ms: int) -> list[array]:
        """For each subject whose probe is due, the few messages to try again now. The next probe is
        set at once, whatever becomes of this one: a probe that never comes back (its messages
        cancelled meanwhile, a send that hangs) cannot stop the subject being probed."""
        probes = []
        while self._probes and self._probes[0][0] <= now_ms:
            _, _, subject, parked, probe_at = heapq.heappop(self._probes)
            if not self._current(subject, parked, probe_at):
                continue
            if not parked.values:  # nothing to probe now; more may come (park pushes it again)
                self._push(self._forgets, probe_at + _ms(EMPTY_KEPT_S), subject, parked, probe_at)
                continue
            probe = parked.values[:PROBE_MESSAGES]  # the oldest: a failed probe goes to the back
            del parked.values[:PROBE_MESSAGES]
            parked.probes += 1
            parked.probe_at_ms = now_ms + _ms(PROBE_BACKOFF_S[min(parked.probes, len(PROBE_BACKOFF_S) - 1)])
            self._push(self._probes, parked.probe_at_ms, subject, parked)
            self.count -= len(probe)
            probes.append(probe)
        while self._forgets and self._forgets[0][0] <= now_ms:
            _, _, subject, parked, probe_at = heapq.heappop(self._forgets)
            if self._current(subject, parked, probe_at) and not parked.values:
                del self.subjects[subject]
        return probes

    def next_probe_ms(self) -> int | None:
        """When the first probe is due (of a subject with messages parked); None when none is."""
        probes = self._probes
        while probes:
            _, _, subject, parked, probe_at = probes[0]
            if self._current(subject, parked, probe_at) and parked.values:
                return probe_at
            heapq.heappop(probes)
            if self._current(subject, parked, probe_at):  # empty: forgotten in the end unless more come
                self._push(self._forgets, probe_at + _ms(EMPTY_KEPT_S), subject, parked, probe_at)
        return None

    def _current(self, subject: str, parked: ParkedSubject, probe_at: int) -> bool:
        """Whether a heap entry still stands for `subject`: still parked as `parked`, probe not moved."""
        return self.subjects.get(subject) is parked and parked.probe_at_ms == probe_at

    def _push(
        self,
        heap: list[tuple[int, int, str, ParkedSubject, int]],
        at_ms: int,
        subject: str,
        parked: ParkedSubject,
        probe_at: int | None = None,
    ) -> None:
        heapq.heappush(heap, (at_ms, next(self._turns), subject, parked, at_ms if probe_at is None else probe_at))

    def stats(self) -> dict[str, int]:
        """The subjects with the most messages parked (at most STATS_SUBJECTS): subject -> count."""
        counts = sorted(((len(p.values), s) for s, p in self.subjects.items() if p.values), reverse=True)
        return {subject: count for count, subject in counts[:STATS_SUBJECTS]}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
