"""The pull log: pull sequences map to consume-log sequences; acks are a prefix."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from qmq.broker.pull_log import PullLog


def test_runs_merge_and_lookup_across_them():
    log = PullLog()
    assert log.append([10, 11, 12]) == 0
    assert log.append([13, 20, 21]) == 3
    assert log.lookup(0, 5) == [10, 11, 12, 13, 20, 21]
    assert log.lookup(3, 4) == [13, 20]
    assert len(log._runs) == 2
    with pytest.raises(KeyError):
        log.lookup(5, 6)


def test_acks_are_a_prefix_and_repeats_change_nothing():
    log = PullLog()
    log.append(list(range(100, 110)))
    assert log.ack(3)
    assert log.pending() == list(range(104, 110))
    assert not log.ack(2)
    with pytest.raises(ValueError, match="only 10 were handed out"):
        log.ack(10)
    assert log.ack(9) and log.pending() == [] and log._runs == []


@given(st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=5), max_size=30), st.data())
def test_lookup_agrees_with_a_plain_list(batches, data):
    log = PullLog()
    plain: list[int] = []
    seq = 0
    for gaps in batches:
        seqs = []
        for gap in gaps:
            seq += gap + 1
            seqs.append(seq)
        assert log.append(seqs) == len(plain)
        plain.extend(seqs)
    if plain:
        acked = data.draw(st.integers(-1, len(plain) - 1))
        if acked >= 0:
            log.ack(acked)
        assert log.pending() == plain[acked + 1 :]
        if acked + 1 < len(plain):
            a = data.draw(st.integers(acked + 1, len(plain) - 1))
            b = data.draw(st.integers(a, len(plain) - 1))
            assert log.lookup(a, b) == plain[a : b + 1]
