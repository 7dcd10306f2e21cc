"""Parking (delay_server/parking.py), without I/O: a subject's parked messages are probed one batch at
a time on PROBE_BACKOFF_S, and released all at once."""

from __future__ import annotations

from delay_server.parking import PROBE_BACKOFF_S, Parking


def test_a_parked_subject_is_probed_a_batch_at_a_time_on_the_backoff_then_released_whole() -> None:
    parking = Parking()
    parking.park("s", range(10), now_ms=0)
    parking.park("t", [100], now_ms=0)
    assert len(parking) == 11
    assert parking.next_probe_ms() == PROBE_BACKOFF_S[0] * 1000
    assert parking.due_probes(now_ms=499, size=4) == []
    probes = parking.due_probes(now_ms=500, size=4)
    assert [list(p) for p in probes] == [[0, 1, 2, 3], [100]]
    assert len(parking) == 6  # a probe out is not parked
    parking.park("s", [0, 1, 2, 3], now_ms=510)  # the probe failed: back, the next one later
    assert parking.due_probes(now_ms=1499, size=4) == []
    [probe] = parking.due_probes(now_ms=1500, size=4)
    assert list(probe) == [4, 5, 6, 7]
    parking.park("s", probe, now_ms=1500)
    times = []
    for _ in range(4):  # the interval grows to its last step and stays there
        now = parking.next_probe_ms()
        times.append(now)
        parking.park("s", parking.due_probes(now, size=4)[0], now)
    assert [b - a for a, b in zip([1500, *times], times, strict=False)] == [2000, 2000, 2000, 2000]
    assert sorted(parking.release("s")) == list(range(10))
    assert parking.release("s") is None
    assert len(parking) == 0 and parking.subjects == {}  # "t": its probe took its one message


def test_a_subject_whose_probe_took_its_last_messages_is_forgotten_when_the_next_one_is_due() -> None:
    parking = Parking()
    parking.park("s", [1], now_ms=0)
    assert [list(p) for p in parking.due_probes(500, size=4)] == [[1]]  # then cancelled, say: never comes back
    assert parking.next_probe_ms() is None and parking.due_probes(1500, size=4) == []
    assert parking.subjects == {}
    parking.park("s", [2], now_ms=2000)  # parked anew: probed soon again
    assert parking.next_probe_ms() == 2000 + PROBE_BACKOFF_S[0] * 1000
