"""Parking (delay_server/parking.py), without I/O: a parked subject is probed a few messages at a time
on PROBE_BACKOFF_S and released whole; a release that comes too soon is put off longer each time;
released backlogs go back to the wheel a bounded number per tick, all subjects together, each tick
shared evenly among the subjects releasing (a small one is not held up behind a large one)."""

from __future__ import annotations

from delay_server.parking import (
    EMPTY_KEPT_S,
    PROBE_BACKOFF_S,
    PROBE_MESSAGES,
    RELEASE_BACKOFF_S,
    RELEASE_PER_TICK,
    REPARK_WINDOW_S,
    Parking,
    Release,
)
from delay_server.wheel import TICK_MS

PARKED = 20
SEND_TIMEOUT_MS = 10_000  # the client's send timeout: a refusal may come this long after the send


def hand_out(parking: Parking, from_ms: int) -> list[tuple[int, list[int]]]:
    """The scheduler's part: `due_released` at each tick from `from_ms` on (when `next_release_ms`
    says), until nothing is releasing; (tick, messages put into it) for each tick that had some."""
    ticks, now = [], from_ms
    while parking.releasing:
        values = [v for part in parking.due_released(now) for v in part]
        if values:
            ticks.append((now // TICK_MS, values))
        if parking.releasing:
            now = max(parking.next_release_ms(now), now + 1)
    return ticks


def release_delay_ms(parking: Parking, subject: str, now_ms: int) -> int:
    """How long after `now_ms` (to the tick) the release of `subject` begins."""
    parking.release(subject, now_ms)
    first_tick = hand_out(parking, now_ms)[0][0]
    return first_tick * TICK_MS - now_ms // TICK_MS * TICK_MS


def test_a_parked_subject_is_probed_a_few_at_a_time_on_the_backoff_then_released_whole() -> None:
    parking = Parking()
    assert parking.park("s", range(PARKED), now_ms=0, sent_ms=0) == 0  # newly parked, the first time in a while
    assert parking.park("s", [PARKED], now_ms=10, sent_ms=10) is None  # parked already
    assert len(parking) == PARKED + 1
    assert parking.next_probe_ms() == PROBE_BACKOFF_S[0] * 1000
    assert parking.due_probes(now_ms=499) == []
    [probe] = parking.due_probes(now_ms=500)
    assert list(probe) == list(range(PROBE_MESSAGES))  # the oldest first
    assert len(parking) == PARKED + 1 - PROBE_MESSAGES  # a probe out is not parked
    assert parking.stats() == {"s": PARKED + 1 - PROBE_MESSAGES}
    times, now, probed = [], 500, [*probe]
    for _ in range(4):  # each probe fails: the interval grows to its last step and stays there
        parking.park("s", probe, now, now)
        now = parking.next_probe_ms()
        times.append(now)
        [probe] = parking.due_probes(now)
        probed += probe
    assert [b - a for a, b in zip([500, *times], times, strict=False)] == [1000, 2000, 2000, 2000]
    assert sorted(set(probed)) == list(range(PARKED + 1))  # a failed probe goes to the back: each gets its turn
    parking.park("s", probe, now, now)
    assert parking.release("s", now_ms=now) == PARKED + 1
    [(tick, values)] = hand_out(parking, now)
    assert sorted(values) == list(range(PARKED + 1)) and tick == now // TICK_MS  # all of them, at once
    assert parking.release("s", now_ms=now) is None
    assert len(parking) == 0 and parking.stats() == {} and parking.next_probe_ms() is None


def test_a_subject_parked_again_soon_after_its_release_waits_longer_each_time() -> None:
    parking = Parking()
    now = 0
    delays = []
    sent = now
    for _ in range(len(RELEASE_BACKOFF_S) + 2):
        parking.park("s", [1, 2, 3], now, sent)
        delay_ms = release_delay_ms(parking, "s", now)
        delays.append(delay_ms)
        sent = now + delay_ms  # released, sent as soon as they go, refused after a timeout
        now = sent + SEND_TIMEOUT_MS
    assert delays == [0, *(int(s * 1000) for s in RELEASE_BACKOFF_S), int(RELEASE_BACKOFF_S[-1] * 1000)]
    later = sent + int(REPARK_WINDOW_S * 1000) + 1  # a send begun well after the last release: a new outage
    assert parking.park("s", [1], later + SEND_TIMEOUT_MS, later) == 0
    assert release_delay_ms(parking, "s", later + SEND_TIMEOUT_MS) == 0


def test_a_send_begun_before_a_release_says_nothing_of_it() -> None:
    """Around a failover a delivery sent to the old master fails after the subject was released:
    it parks the subject again, but counts neither for nor against the release."""
    parking = Parking()
    parking.park("s", [1], now_ms=0, sent_ms=0)
    parking.release("s", now_ms=1000)
    assert parking.park("s", [2], now_ms=1500, sent_ms=900) == 0  # in flight before the release
    assert release_delay_ms(parking, "s", now_ms=2000) == 0
    assert parking.park("s", [3], now_ms=2100, sent_ms=2000) == 1  # sent after it: too soon
    assert release_delay_ms(parking, "s", now_ms=2200) == int(RELEASE_BACKOFF_S[0] * 1000)


def test_a_large_release_counts_as_going_until_its_last_tick() -> None:
    parking = Parking()
    parking.park("s", range(3 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("s", now_ms=0)
    assert [(t, len(v)) for t, v in hand_out(parking, 0)] == [
        (0, RELEASE_PER_TICK),
        (1, RELEASE_PER_TICK),
        (2, RELEASE_PER_TICK),
    ]
    sent = 2 * TICK_MS + int(REPARK_WINDOW_S * 1000)  # the window counts from the last tick
    assert parking.park("s", [1], now_ms=sent + SEND_TIMEOUT_MS, sent_ms=sent) == 1


def test_old_releases_are_forgotten() -> None:
    parking = Parking()
    subjects = 5000
    for n in range(subjects):
        parking.park(f"s{n}", [n], now_ms=n, sent_ms=n)
        parking.release(f"s{n}", now_ms=n * 1000)
        parking.due_released(n * 1000)  # it goes at once: over
    assert len(parking._released) < subjects  # those more than REPARK_WINDOW_S old went


def test_released_backlogs_go_back_a_bounded_number_per_tick_shared_evenly() -> None:
    parking = Parking()
    parking.park("a", range(RELEASE_PER_TICK + 5), now_ms=0, sent_ms=0)
    parking.park("b", range(100_000, 100_000 + RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("a", now_ms=1000)
    parking.release("b", now_ms=1000)  # in the same moment: beside a's, not after them
    tick, half = 1000 // TICK_MS, RELEASE_PER_TICK // 2
    ticks = hand_out(parking, 1000)
    assert [(t, len(v)) for t, v in ticks] == [(tick, RELEASE_PER_TICK), (tick + 1, RELEASE_PER_TICK), (tick + 2, 5)]
    a = [x for _, v in ticks for x in v if x < 100_000]
    assert a == list(range(RELEASE_PER_TICK + 5))  # each subject's oldest first
    assert [len([x for x in v if x < 100_000]) for _, v in ticks] == [half, half, 5]
    assert parking.park("b", [9], now_ms=1200, sent_ms=999) == 0  # begun before b's release: no verdict
    parking.park("d", [7], now_ms=1000, sent_ms=1000)
    parking.subjects["d"].streak = len(RELEASE_BACKOFF_S)  # d's releases keep coming too soon: put off 30 s
    parking.release("d", now_ms=1000)
    parking.park("e", [8], now_ms=1000, sent_ms=1000)
    parking.release("e", now_ms=1000)
    assert hand_out(parking, 1000) == [(tick, [8]), ((1000 + 30_000) // TICK_MS, [7])]  # e not held back by d
    parking.park("c", [1], now_ms=60_000, sent_ms=60_000)
    parking.release("c", now_ms=60_000)
    assert hand_out(parking, 60_000) == [(60_000 // TICK_MS, [1])]  # later: at once again


def test_a_small_subject_released_behind_a_large_backlog_goes_in_the_next_tick() -> None:
    """First come, first served would hold it until the backlog's last tick (about 16,000 messages a
    second: a minute behind a backlog of a million)."""
    parking = Parking()
    parking.park("large", range(10 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.park("small", range(-10, 0), now_ms=0, sent_ms=0)
    parking.release("large", now_ms=0)
    assert len(parking.due_released(0)[0]) == RELEASE_PER_TICK  # the whole first tick
    parking.release("small", now_ms=100)
    assert parking.due_released(100) == []  # this tick is full
    assert parking.next_release_ms(100) == TICK_MS
    second = [x for part in parking.due_released(TICK_MS) for x in part]
    assert [x for x in second if x < 0] == list(range(-10, 0)) and len(second) == RELEASE_PER_TICK
    assert parking.releasing_count == 8 * RELEASE_PER_TICK + 10  # of the large one's, 8 ticks' worth left
    assert parking.park("small", [-11], now_ms=600, sent_ms=TICK_MS - 1) == 0  # begun before its first tick


def test_a_subject_parked_again_while_its_release_goes_takes_the_rest_back() -> None:
    parking = Parking()
    parking.park("s", range(3 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("s", now_ms=0)
    went = [x for part in parking.due_released(0) for x in part]
    assert went == list(range(RELEASE_PER_TICK))
    assert parking.park("s", went[:8], now_ms=400, sent_ms=100) == 1  # sent after the release: too soon
    assert parking.releasing == {} and parking.releasing_count == 0
    assert len(parking) == 8 + 2 * RELEASE_PER_TICK  # the failed ones, then the rest of the release
    assert parking.due_released(TICK_MS) == [] and parking.next_release_ms(TICK_MS) is None


def test_a_subject_whose_probe_took_its_last_messages_is_not_probed_until_more_are_parked() -> None:
    parking = Parking()
    parking.park("s", [1], now_ms=0, sent_ms=0)
    assert [list(p) for p in parking.due_probes(500)] == [[1]]  # then cancelled, say: never comes back
    assert parking.next_probe_ms() is None and parking.due_probes(10_000) == []
    assert parking.park("s", [2], now_ms=10_000, sent_ms=10_000) is None  # still parked: probed on its schedule
    assert parking.next_probe_ms() == 500 + PROBE_BACKOFF_S[1] * 1000
    assert [list(p) for p in parking.due_probes(10_000)] == [[2]]  # its probe time passed while it was empty


def test_a_subject_whose_last_probe_never_came_back_is_forgotten_in_the_end() -> None:
    parking = Parking()
    parking.park("s", [1], now_ms=0, sent_ms=0)
    assert [list(p) for p in parking.due_probes(500)] == [[1]]  # then cancelled: it never comes back
    next_probe_ms = 500 + int(PROBE_BACKOFF_S[1] * 1000)
    parking.due_probes(next_probe_ms + int(EMPTY_KEPT_S * 1000) - 1)
    assert "s" in parking.subjects  # a probe's failure may still come back and park it again
    parking.due_probes(next_probe_ms + int(EMPTY_KEPT_S * 1000))
    assert parking.subjects == {} and len(parking) == 0
    later_ms = next_probe_ms + int(EMPTY_KEPT_S * 1000) + 1
    assert parking.park("s", [2], now_ms=later_ms, sent_ms=later_ms) == 0  # parked anew: a new outage


def test_a_send_that_says_nothing_of_a_going_release_leaves_it_going() -> None:
    """Begun before the release, or while it waited for its first tick: the failed messages are
    parked, the release goes on whole, and the next release of the subject joins it."""
    parking = Parking()
    parking.park("large", range(10_000_000, 10_000_000 + RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.park("s", range(2 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("large", now_ms=0)
    parking.due_released(0)  # the large one fills tick 0
    parking.release("s", now_ms=100)  # its first tick is tick 1
    assert parking.park("s", [-1], now_ms=300, sent_ms=200) == 0  # sent while it waited: nothing told
    assert parking.releasing["s"].sent == 0 and parking.releasing_count == 2 * RELEASE_PER_TICK
    went = [x for part in parking.due_released(TICK_MS) for x in part]
    assert went == list(range(RELEASE_PER_TICK))  # it began at tick 1 all the same
    assert parking.park("s", [-2], now_ms=TICK_MS + 100, sent_ms=50) is None  # begun before the release
    assert parking.releasing_count == RELEASE_PER_TICK  # nothing taken back
    assert parking.release("s", now_ms=TICK_MS + 200) == 2  # the failed ones join the release going
    assert [x for part in parking.due_released(2 * TICK_MS) for x in part] == [
        *range(RELEASE_PER_TICK, 2 * RELEASE_PER_TICK)
    ]
    assert [x for part in parking.due_released(3 * TICK_MS) for x in part] == [-1, -2]
    assert parking.releasing == {} and parking.releasing_count == 0 and len(parking) == 0


def test_a_clock_stepped_back_does_not_give_a_tick_its_room_twice() -> None:
    parking = Parking()
    parking.park("s", range(3 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("s", now_ms=10 * TICK_MS)
    assert len(parking.due_released(10 * TICK_MS)[0]) == RELEASE_PER_TICK
    assert parking.due_released(9 * TICK_MS) == []  # stepped back: still within tick 10's room
    assert parking.due_released(10 * TICK_MS + 1) == []
    assert len(parking.due_released(11 * TICK_MS)[0]) == RELEASE_PER_TICK


def test_a_clock_stepped_back_while_a_release_goes_makes_the_fire_loop_wait_not_spin() -> None:
    """The scheduler sleeps until `next_release_ms`: a time at which `due_released` hands out nothing
    (this tick's room is used up) would have it wake again at once, for ever."""
    parking = Parking()
    parking.park("s", range(3 * RELEASE_PER_TICK), now_ms=0, sent_ms=0)
    parking.release("s", now_ms=10 * TICK_MS)
    assert len(parking.due_released(10 * TICK_MS)[0]) == RELEASE_PER_TICK
    back = 9 * TICK_MS
    when = parking.next_release_ms(back)
    assert when is not None and back < when <= 11 * TICK_MS
    assert len(parking.due_released(11 * TICK_MS)[0]) == RELEASE_PER_TICK


def test_a_release_waiting_for_room_is_remembered_past_the_window() -> None:
    """Its verdict is still to come: its record must outlive the forgetting of old releases."""
    parking = Parking()
    parking.park("waiting", [1], now_ms=0, sent_ms=0)
    parking.release("waiting", now_ms=0)  # not handed out yet (ticks full of others', say)
    parking._released.update({f"old{n}": Release(0, 0, 0) for n in range(2000)})
    later = int(REPARK_WINDOW_S * 1000) * 2
    parking.park("other", [2], now_ms=later, sent_ms=later)
    parking.release("other", now_ms=later)  # forgets the old releases
    assert "old0" not in parking._released and "waiting" in parking._released
