"""The broker's consumption state without I/O: the action journal's encoding, the retry schedule, and
`BrokerState` replayed in full or from a snapshot (plus the snapshot file itself)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qmq.broker import journal, snapshot
from qmq.broker.consumer_group import Ack, Pull, Release, Reset
from qmq.broker.journal import Create, Entry, Fired, GroupAction, Redriven, Schedule
from qmq.broker.retry import RetrySchedule
from qmq.broker.state import BrokerState
from qmq.broker.system_subjects import dead_subject, retry_subject

# -- the journal's encoding -----------------------------------------------------------------------------

EVERY_KIND: list[Entry] = [
    Create("orders", "g1", 17, False),
    Create("orders", "g1.bc-0123456789ab", 0, True),
    GroupAction("orders", "g1", Pull("c-1", 0, (17, 18, 19, 25, 26, 40), 41)),
    GroupAction("%RETRY%orders%g1", "g1", Pull("c@host:1", 12, (3,), 4)),
    GroupAction("orders", "g1", Ack("c-1", 4)),
    GroupAction("orders", "g1", Release("c-1", 5)),
    GroupAction("orders", "g1", Reset(0)),
    Schedule(7, 1_700_000_000_123, 4096, 2, "%RETRY%orders%g1", "handler raised KeyError('x')"),
    Schedule(8, 5, 0, 33, "%RETRY%orders%g1"),  # reason defaults to ""
    Fired((7, 8, 100)),
    Fired(()),
    Redriven("%DEAD%orders%g1", 12),
]


@pytest.mark.parametrize(
    "entry",
    EVERY_KIND,
    ids=lambda e: (
        type(e).__name__ + getattr(getattr(e, "action", None), "__class__", type(None)).__name__.replace("NoneType", "")
    ),
)
def test_every_entry_kind_round_trips_alone(entry: Entry) -> None:
    assert journal.decode(journal.encode([entry])) == [entry]


def test_a_record_of_many_entries_round_trips_in_order() -> None:
    payload = journal.encode(EVERY_KIND)
    assert journal.decode(payload) == EVERY_KIND
    assert journal.decode(journal.encode([])) == []


def test_a_long_pull_is_stored_as_runs_and_costs_a_few_bytes() -> None:
    pull = GroupAction("s", "g", Pull("c", 0, tuple(range(1000, 2000)), 2000))
    payload = journal.encode([pull])
    assert len(payload) < 40
    assert msgpack.unpackb(payload)[0][5] == [[1000, 1000]]
    assert journal.decode(payload) == [pull]


@pytest.mark.parametrize(
    ("seqs", "expected"),
    [
        ([], []),
        ([5], [[5, 1]]),
        ([1, 2, 3, 7, 8, 10], [[1, 3], [7, 2], [10, 1]]),
        ([4, 3, 2], [[4, 1], [3, 1], [2, 1]]),  # not ascending: one run each, order kept
        ([2, 2], [[2, 1], [2, 1]]),
    ],
)
def test_runs(seqs: list[int], expected: list[list[int]]) -> None:
    assert journal.runs(seqs) == expected
    assert journal.unruns(expected) == tuple(seqs)


@given(st.lists(st.integers(min_value=0, max_value=2**40), max_size=200))
def test_unruns_undoes_runs(seqs: list[int]) -> None:
    pairs = journal.runs(seqs)
    assert journal.unruns(pairs) == tuple(seqs)
    assert all(count >= 1 for _, count in pairs)
    # Consecutive runs never continue each other (else they would have been one run).
    assert all(a[0] + a[1] != b[0] for a, b in itertools.pairwise(pairs))


def test_an_unknown_entry_kind_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown journal entry kind 'Z'"):
        journal.decode(msgpack.packb([["Z", 1]]))


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",  # the one byte msgpack never uses
        b"",
        msgpack.packb([["P", "s", "g", "c", 0, [[1, "x"]], 3]]),  # a run that is not numbers
        msgpack.packb([["S", 1, 2, 3]]),  # a schedule cut short
        msgpack.packb([["A"]]),
        msgpack.packb(7),
        msgpack.packb([["F", 5]]),
        msgpack.packb([{"kind": "P"}]),  # an entry that is a map, not a list
        msgpack.packb([{0: "A"}]),
    ],
    ids=[
        "bad-byte",
        "empty",
        "bad-run",
        "short-schedule",
        "short-ack",
        "not-a-list",
        "fired-not-a-list",
        "entry-is-a-map",
        "entry-is-a-map-with-key-0",
    ],
)
def test_a_record_this_version_cannot_read_is_a_value_error(payload: bytes) -> None:
    """decode() promises ValueError for any record it cannot read, so recovery can report it."""
    with pytest.raises(ValueError, match="unreadable journal record"):
        journal.decode(payload)


# -- the retry schedule ---------------------------------------------------------------------------------


def sched(schedule_id: int, due_ms: int, subject: str = "%RETRY%s%g") -> Schedule:
    return Schedule(schedule_id, due_ms, 1000 + schedule_id, 2, subject, f"r{schedule_id}")


def test_take_due_hands_out_what_is_due_earliest_first_ties_by_id() -> None:
    retries = RetrySchedule()
    for entry in [sched(0, 30), sched(1, 10), sched(2, 20), sched(3, 10), sched(4, 50)]:
        retries.add(entry)
    assert retries.next_due() == 10
    assert retries.take_due(now_ms=9, limit=10) == []
    assert [e.id for e in retries.take_due(now_ms=25, limit=10)] == [1, 3, 2]
    assert len(retries) == 5  # taken is not fired: still pending
    assert retries.next_due() == 30
    assert [e.id for e in retries.take_due(now_ms=1000, limit=1)] == [0]
    assert [e.id for e in retries.take_due(now_ms=1000, limit=1)] == [4]
    assert retries.take_due(now_ms=1000, limit=1) == []
    assert retries.next_due() is None
    assert retries.next_id == 5


def test_put_back_makes_an_entry_due_again_unless_it_was_fired_meanwhile() -> None:
    retries = RetrySchedule()
    for entry in [sched(0, 10), sched(1, 20), sched(2, 30)]:
        retries.add(entry)
    taken = retries.take_due(now_ms=100, limit=2)
    assert [e.id for e in taken] == [0, 1]
    retries.fired([1])
    retries.put_back(taken)  # the append failed; 1 was fired by someone else in between
    assert retries.next_due() == 10
    assert [e.id for e in retries.take_due(now_ms=100, limit=10)] == [0, 2]


def test_fired_entries_leave_the_schedule_and_their_subject_count() -> None:
    a, b = "%RETRY%s%a", "%RETRY%s%b"
    retries = RetrySchedule()
    for entry in [sched(0, 10, a), sched(1, 20, a), sched(2, 15, b)]:
        retries.add(entry)
    assert (retries.pending_for(a), retries.pending_for(b), retries.pending_for("%RETRY%x%y")) == (2, 1, 0)
    retries.fired([0, 99])  # an unknown id is ignored
    assert (len(retries), retries.pending_for(a), retries.pending_for(b)) == (2, 1, 1)
    retries.fired([0])  # twice is a no-op
    assert retries.pending_for(a) == 1
    retries.fired((1, 2))
    assert (len(retries), retries.pending_for(a), retries.pending_for(b)) == (0, 0, 0)
    assert retries.entries() == []


def test_next_due_skips_fired_entries() -> None:
    retries = RetrySchedule()
    for entry in [sched(0, 10), sched(1, 20), sched(2, 5)]:
        retries.add(entry)
    assert retries.next_due() == 5
    retries.fired([2, 0])
    assert retries.next_due() == 20
    assert [e.id for e in retries.take_due(now_ms=15, limit=10)] == []
    retries.fired([1])
    assert retries.next_due() is None
    assert retries.take_due(now_ms=10**15, limit=10) == []


def test_entries_are_sorted_by_due_then_id_and_next_id_follows_the_highest() -> None:
    retries = RetrySchedule()
    for entry in [sched(9, 10), sched(3, 10), sched(5, 1)]:
        retries.add(entry)
    assert [e.id for e in retries.entries()] == [5, 3, 9]
    assert retries.next_id == 10


# -- BrokerState: live, replayed, and from a snapshot ------------------------------------------------------

SUBJECT = "orders"
GROUPS = ["g1", "g2"]
CONSUMERS = ["c1", "c2", "c3"]


@dataclass
class Simulation:
    """Drives a BrokerState the way the broker does (group.pull / group.ack / silent releases / nacks /
    fired retries / re-drives), collecting the journal entries it would write."""

    live: BrokerState = field(default_factory=BrokerState)
    entries: list[Entry] = field(default_factory=list)
    end: int = 0  # messages stored in SUBJECT
    retry_end: dict[str, int] = field(default_factory=dict)  # messages in each retry subject
    seen: dict[tuple[str, str, str], int] = field(default_factory=dict)  # last pull seq a consumer saw
    now: float = 0.0

    def commit(self, entries: list[Entry], *, apply: bool) -> None:
        if apply:
            for entry in entries:
                self.live.apply(entry, self.now)
        self.entries.extend(entries)

    def read_over(self, end: int):
        def read(start: int, count: int) -> tuple[list[int], int]:
            seqs = list(range(start, min(end, start + count)))
            return seqs, max(start, seqs[-1] + 1 if seqs else start)

        return read

    def pull(self, group_key: str, consumer: str, count: int, restarted: bool, from_retry: bool) -> None:
        stored = retry_subject(SUBJECT, group_key) if from_retry else SUBJECT
        end = self.retry_end.get(stored, 0) if from_retry else self.end
        entries: list[Entry] = []
        group = self.live.group(stored, group_key)
        if group is None:
            create = Create(stored, group_key, 0 if from_retry else end, False)
            self.live.apply(create, self.now)
            entries.append(create)
            group = self.live.group(stored, group_key)
        client_pulled = -1 if restarted else self.seen.get((stored, group_key, consumer), -1)
        delivery, action = group.pull(consumer, client_pulled, count, self.read_over(end), self.now)
        if action is not None:
            entries.append(GroupAction(stored, group_key, action))
        if delivery.seqs:
            last = delivery.first_pull + len(delivery.seqs) - 1
            key = (stored, group_key, consumer)
            self.seen[key] = max(self.seen.get(key, -1), last)
        self.commit(entries, apply=False)  # already applied, as in the broker

    def ack(self, group_key: str, consumer: str, count: int, from_retry: bool) -> None:
        stored = retry_subject(SUBJECT, group_key) if from_retry else SUBJECT
        group = self.live.group(stored, group_key)
        if group is None or consumer not in group.consumers:
            return
        log = group.consumers[consumer].pull_log
        if not log.unacked:
            return
        action = group.ack(consumer, min(log.pull_seq - 1, log.ack_seq + count - 1), self.now)
        if action is not None:
            self.commit([GroupAction(stored, group_key, action)], apply=False)

    def release_silent(self, timeout: float) -> None:
        for group in list(self.live.groups.values()):
            for release, seqs in group.silent(self.now, timeout):
                retry = retry_subject(SUBJECT, group.group)
                self.retry_end[retry] = self.retry_end.get(retry, 0) + len(seqs)
                self.commit([GroupAction(group.subject, group.group, release)], apply=True)

    def reset(self, group_key: str, cursor: int) -> None:
        cursor = min(cursor, self.end)
        if self.live.group(SUBJECT, group_key) is None:
            self.commit([Create(SUBJECT, group_key, cursor, False)], apply=True)
        else:
            self.commit([GroupAction(SUBJECT, group_key, Reset(cursor))], apply=True)

    def nack(self, group_key: str, offset: int, delay_ms: int, attempt: int) -> None:
        schedule = Schedule(
            self.live.retries.next_id,
            int(self.now * 1000) + delay_ms,
            offset,
            attempt,
            retry_subject(SUBJECT, group_key),
            f"failed at {self.now}",
        )
        self.commit([schedule], apply=True)

    def fire(self, limit: int) -> None:
        due = self.live.retries.take_due(int(self.now * 1000), limit)
        for entry in due:
            self.retry_end[entry.retry_subject] = self.retry_end.get(entry.retry_subject, 0) + 1
        if due:
            self.commit([Fired(tuple(e.id for e in due))], apply=True)

    def redrive(self, group_key: str, upto: int) -> None:
        self.commit([Redriven(dead_subject(SUBJECT, group_key), upto)], apply=True)


def view(state: BrokerState) -> dict:
    """Everything observable about a state, in plain values."""
    groups = {}
    for (stored, key), group in state.groups.items():
        groups[(stored, key)] = (
            group.cursor,
            group.broadcast,
            {
                cid: (c.pull_log.pull_seq, c.pull_log.ack_seq, c.pull_log.pending())
                for cid, c in group.consumers.items()
            },
        )
    return {
        "groups": groups,
        "retries": state.retries.entries(),
        "next_due": state.retries.next_due(),
        "retry_next_id": state.retries.next_id,
        "pending_for": {g: state.retries.pending_for(retry_subject(SUBJECT, g)) for g in GROUPS},
        "redriven": dict(state.redriven),
        "snapshot": {k: v for k, v in state.to_snapshot().items() if k != "journal_seq"},
    }


def replay(
    entries: list[Entry], state: BrokerState | None = None, *, record_size: int = 3, now: float = 1000.0
) -> BrokerState:
    """Apply `entries` as recovery does: through the journal's encoding, a few entries per record."""
    state = state or BrokerState()
    for i in range(0, len(entries), record_size):
        for entry in journal.decode(journal.encode(entries[i : i + record_size])):
            state.apply(entry, now)
            state.journal_seq += 1
    return state


def through_snapshot(state: BrokerState, now: float = 2000.0) -> BrokerState:
    data = msgpack.unpackb(msgpack.packb(state.to_snapshot(), use_bin_type=True), raw=False, strict_map_key=False)
    return BrokerState.from_snapshot(data, now)


def scripted() -> Simulation:
    sim = Simulation()
    sim.end = 10
    sim.pull("g1", "c1", 4, restarted=False, from_retry=False)  # group made at the latest: nothing yet
    sim.end = 30
    sim.pull("g1", "c1", 4, restarted=False, from_retry=False)  # 10-13
    sim.pull("g1", "c2", 5, restarted=False, from_retry=False)  # 14-18
    sim.ack("g1", "c1", 2, from_retry=False)
    sim.reset("g2", 0)
    sim.pull("g2", "c1", 7, restarted=False, from_retry=False)  # 0-6
    sim.nack("g1", offset=4242, delay_ms=500, attempt=1)
    sim.nack("g1", offset=4343, delay_ms=100, attempt=3)
    sim.nack("g2", offset=99, delay_ms=10_000, attempt=1)
    sim.now = 0.2
    sim.fire(10)  # the one due at 100 ms
    sim.pull("g1", "c3", 10, restarted=False, from_retry=True)
    sim.now = 100.0
    sim.pull("g1", "c2", 5, restarted=False, from_retry=False)  # c2 is alive; c1 went silent
    sim.release_silent(timeout=60.0)
    sim.redrive("g1", 3)
    sim.redrive("g1", 2)  # never goes back
    return sim


def test_scripted_history_replayed_and_restored_from_a_snapshot_at_every_point() -> None:
    sim = scripted()
    live = view(sim.live)
    assert live["groups"][(SUBJECT, "g1")][2]["c1"] == (4, 4, [])  # released
    assert live["groups"][(SUBJECT, "g1")][2]["c2"] == (10, 0, list(range(14, 19)) + list(range(19, 24)))
    assert live["groups"][(SUBJECT, "g2")][0] == 7
    assert [e.id for e in live["retries"]] == [0, 2]
    assert live["redriven"] == {dead_subject(SUBJECT, "g1"): 3}
    # g1: one fired, c1's two and c3's one released; g2: c1's seven released.
    assert sim.retry_end == {retry_subject(SUBJECT, "g1"): 4, retry_subject(SUBJECT, "g2"): 7}

    assert view(replay(sim.entries)) == live
    for cut in range(len(sim.entries) + 1):
        partial = replay(sim.entries[:cut])
        assert partial.journal_seq == cut
        restored = through_snapshot(partial)
        assert restored.journal_seq == cut
        assert view(restored) == view(partial)
        assert view(replay(sim.entries[cut:], restored)) == live, f"snapshot after entry {cut}"


def test_a_snapshot_of_another_version_is_refused() -> None:
    data = BrokerState().to_snapshot()
    data["version"] = 2
    with pytest.raises(ValueError, match="snapshot version 2"):
        BrokerState.from_snapshot(data, now=0.0)


def test_the_retry_id_counter_survives_a_snapshot_even_when_every_retry_fired() -> None:
    """Ids are never reused: a new nack after a restart must not take the id of a fired schedule
    (its Fired entry may still be in the journal after the snapshot)."""
    sim = Simulation()
    sim.nack("g1", offset=1, delay_ms=0, attempt=1)
    sim.nack("g1", offset=2, delay_ms=0, attempt=1)
    sim.fire(10)
    restored = through_snapshot(replay(sim.entries))
    assert len(restored.retries) == 0
    assert restored.retries.next_id == 2


OPS = st.one_of(
    st.tuples(st.just("send"), st.integers(1, 12)),
    st.tuples(
        st.just("pull"),
        st.sampled_from(GROUPS),
        st.sampled_from(CONSUMERS),
        st.integers(1, 8),
        st.booleans(),
        st.booleans(),
    ),
    st.tuples(st.just("ack"), st.sampled_from(GROUPS), st.sampled_from(CONSUMERS), st.integers(1, 8), st.booleans()),
    st.tuples(st.just("tick"), st.integers(1, 40)),
    st.tuples(
        st.just("release"),
    ),
    st.tuples(st.just("reset"), st.sampled_from(GROUPS), st.integers(0, 100)),
    st.tuples(
        st.just("nack"), st.sampled_from(GROUPS), st.integers(0, 10**6), st.integers(0, 30_000), st.integers(1, 5)
    ),
    st.tuples(st.just("fire"), st.integers(1, 4)),
    st.tuples(st.just("redrive"), st.sampled_from(GROUPS), st.integers(0, 50)),
)


def run_ops(ops: list[tuple]) -> Simulation:
    sim = Simulation()
    for op in ops:
        kind, args = op[0], op[1:]
        if kind == "send":
            sim.end += args[0]
        elif kind == "pull":
            sim.pull(*args)
        elif kind == "ack":
            sim.ack(*args)
        elif kind == "tick":
            sim.now += args[0]
        elif kind == "release":
            sim.release_silent(timeout=30.0)
        elif kind == "reset":
            sim.reset(*args)
        elif kind == "nack":
            sim.nack(*args)
        elif kind == "fire":
            sim.fire(*args)
        else:
            sim.redrive(*args)
    return sim


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(OPS, max_size=60), cut=st.floats(0, 1), record_size=st.integers(1, 5))
def test_snapshot_plus_replay_equals_full_replay_equals_the_live_state(ops, cut, record_size) -> None:
    sim = run_ops(ops)
    live = view(sim.live)
    assert view(replay(sim.entries, record_size=record_size)) == live
    k = int(cut * len(sim.entries))
    restored = through_snapshot(replay(sim.entries[:k], record_size=record_size))
    assert view(replay(sim.entries[k:], restored, record_size=record_size)) == live
    # And a second snapshot of the result is the same snapshot.
    again = through_snapshot(restored)
    assert again.to_snapshot() == restored.to_snapshot()


# -- the snapshot file ----------------------------------------------------------------------------------


def test_snapshot_save_and_load_round_trip(tmp_path) -> None:
    directory = tmp_path / "consumers"
    assert snapshot.load(directory) is None  # none yet: a fresh broker
    state = scripted().live
    state.journal_seq = 42
    snapshot.save(directory, state.to_snapshot())
    assert [p.name for p in directory.iterdir()] == [snapshot.FILE_NAME]  # no temporary file left
    loaded = snapshot.load(directory)
    assert loaded == msgpack.unpackb(msgpack.packb(state.to_snapshot()), strict_map_key=False)
    restored = BrokerState.from_snapshot(loaded, now=0.0)
    assert restored.journal_seq == 42
    assert view(restored) == view(state)

    state.journal_seq = 43  # a later snapshot replaces the earlier one whole
    snapshot.save(directory, state.to_snapshot())
    assert snapshot.load(directory)["journal_seq"] == 43


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda data: data[:-1], "fails its CRC check"),  # cut short
        (lambda data: data[:20] + bytes([data[20] ^ 0x01]) + data[21:], "fails its CRC check"),  # one bit flipped
        (lambda data: data + b"\x00", "fails its CRC check"),  # trailing byte
        (lambda data: data[:5], "truncated snapshot"),
        (lambda data: b"", "truncated snapshot"),
    ],
    ids=["cut-short", "bit-flip", "trailing-byte", "shorter-than-header", "empty"],
)
def test_a_damaged_snapshot_is_an_error_naming_the_file(tmp_path, damage, message) -> None:
    state = scripted().live
    snapshot.save(tmp_path, state.to_snapshot())
    path = tmp_path / snapshot.FILE_NAME
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(snapshot.SnapshotError, match=message) as failed:
        snapshot.load(tmp_path)
    assert str(path) in str(failed.value)
