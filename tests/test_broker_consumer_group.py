"""The consumer-group state machine: shared cursor, pull logs, resends, releases, replay."""

import random

import pytest

from qmq.broker.consumer_group import ConsumerGroup, Pull, Release, Reset, UnknownConsumer


def reader_over(end, keep=lambda seq: True):
    def read(start, count):
        seqs, seq = [], start
        while seq < end and len(seqs) < count:
            if keep(seq):
                seqs.append(seq)
            seq += 1
        return seqs, seq

    return read


def test_two_consumers_split_a_backlog_without_overlap():
    group = ConsumerGroup("s", "g")
    read = reader_over(10_000)
    got = {"a": [], "b": []}
    pulled = {"a": -1, "b": -1}
    rng = random.Random(7)
    while group.cursor < 10_000:
        who = rng.choice("ab")
        delivery, _ = group.pull(who, pulled[who], rng.randint(1, 100), read, now=0)
        got[who].extend(delivery.seqs)
        pulled[who] = delivery.first_pull + len(delivery.seqs) - 1
        group.ack(who, pulled[who], now=0)
    assert sorted(got["a"] + got["b"]) == list(range(10_000))
    assert not set(got["a"]) & set(got["b"])
    assert group.in_flight() == 0 and group.backlog(10_000) == 0


def test_a_restarted_consumer_gets_its_unacked_messages_first():
    group = ConsumerGroup("s", "g")
    read = reader_over(100)
    first, _ = group.pull("a", -1, 10, read, now=0)
    group.ack("a", first.first_pull + 3, now=0)  # handled 4 of 10, then the process died
    again, action = group.pull("a", -1, 100, read, now=1)
    assert again.resent and action is None
    assert again.first_pull == 4 and again.seqs == first.seqs[4:]
    fresh, _ = group.pull("a", 9, 5, read, now=1)  # it now holds everything up to pull seq 9
    assert fresh.seqs == [10, 11, 12, 13, 14] and not fresh.resent


def test_a_silent_consumer_releases_its_unacked_messages():
    group = ConsumerGroup("s", "g")
    read = reader_over(100)
    group.pull("a", -1, 10, read, now=0)
    group.ack("a", 1, now=0)
    group.pull("b", -1, 10, read, now=50)
    assert group.silent(now=30, timeout=60) == []
    released = group.silent(now=61, timeout=60)
    assert [(r.consumer, seqs) for r, seqs in released] == [("a", list(range(2, 10)))]
    group.apply(released[0][0])
    assert group.consumers["a"].pull_log.unacked == 0
    assert group.in_flight() == 10


def test_a_consumer_that_leaves_gives_back_what_it_holds_split_at_what_its_application_saw():
    group = ConsumerGroup("s", "g")
    read = reader_over(100, keep=lambda seq: seq % 2 == 0)
    group.pull("a", -1, 10, read, now=0)  # pull seqs 0-9: consume-log seqs 0, 2, ..., 18
    group.ack("a", 1, now=0)
    release, handed, unseen = group.leaving("a", seen=5)
    assert release == Release("a", 9)
    assert handed == [4, 6, 8, 10] and unseen == [12, 14, 16, 18]
    assert group.leaving("a", seen=-1)[1:] == ([], list(range(4, 20, 2)))  # the application saw none
    assert group.leaving("a", seen=0)[1:] == ([], list(range(4, 20, 2)))  # nor any unacked one
    assert group.leaving("a", seen=40)[1:] == (list(range(4, 20, 2)), [])  # more than it holds: all seen
    group.apply(release)
    assert group.leaving("a", seen=9) is None  # holds nothing now
    assert group.leaving("nobody", seen=0) is None
    broadcast = ConsumerGroup("s", "b#a", broadcast=True)
    broadcast.pull("a", -1, 5, read, now=0)
    assert broadcast.leaving("a", seen=0) is None  # its position is its own: nothing to give to others


def test_filters_move_the_cursor_and_unknown_consumers_are_refused():
    group = ConsumerGroup("s", "g")
    read = reader_over(50, keep=lambda seq: seq % 10 == 0)
    delivery, action = group.pull("a", -1, 3, read, now=0)
    assert delivery.seqs == [0, 10, 20] and action.cursor == 21
    with pytest.raises(UnknownConsumer, match="never pulled"):
        group.ack("nobody", 0, now=0)
    with pytest.raises(ValueError, match="handed out"):
        group.ack("a", 3, now=0)


def test_replaying_the_actions_rebuilds_the_same_state():
    live = ConsumerGroup("s", "g")
    journal = [Reset(5)]
    live.apply(journal[0])
    read = reader_over(1000, keep=lambda seq: seq % 3 != 0)
    rng = random.Random(3)
    pulled = {}
    for _ in range(200):
        who = rng.choice(["a", "b", "c"])
        delivery, action = live.pull(who, pulled.get(who, -1), rng.randint(1, 20), read, now=0)
        if action:
            journal.append(action)
        if delivery.seqs:
            pulled[who] = delivery.first_pull + len(delivery.seqs) - 1
            if rng.random() < 0.7:
                ack = live.ack(who, delivery.first_pull + rng.randrange(len(delivery.seqs)), now=0)
                if ack:
                    journal.append(ack)
    replayed = ConsumerGroup("s", "g")
    for action in journal:
        replayed.apply(action)
    last_pull_cursor = max(a.cursor for a in journal if isinstance(a, Pull))
    assert replayed.cursor == last_pull_cursor <= live.cursor
    for who, consumer in live.consumers.items():
        log, other = consumer.pull_log, replayed.consumers[who].pull_log
        assert (log.pull_seq, log.ack_seq, log.pending()) == (other.pull_seq, other.ack_seq, other.pending())
