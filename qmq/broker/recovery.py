"""The broker's consumption state at start: its last snapshot, then the journal after it.

Blocking (it reads the store): run it before serving. A replica keeps the same state as it copies
the log (replica_state.py) with `load` and `replay`; a master recovers it with `recover`.
"""

from __future__ import annotations

import logging
from pathlib import Path

from qmq.broker import journal, snapshot
from qmq.broker.state import BrokerState
from qmq.protocol.limits import ACTION_SUBJECT
from qmq.store.store import LogStore

log = logging.getLogger("qmq.broker")

REPLAY_BATCH = 256  # journal records read per step


def recover(store: LogStore, state_dir: Path, now: float) -> BrokerState:
    state = load(store, state_dir, now)
    replayed = replay(store, state, now)
    log.info(
        "consumption state: %d groups, %d pending retries, %d journal entries replayed",
        len(state.groups),
        len(state.retries),
        replayed,
    )
    return state


def load(store: LogStore, state_dir: Path, now: float, *, ahead_ok: bool = False) -> BrokerState:
    """The last snapshot's state (an empty one without a usable snapshot). A snapshot covering more
    journal than the store holds is discarded, unless `ahead_ok`: a replica that copied its
    master's snapshot holds it before the journal it covers has arrived (state_copy.py)."""
    try:
        saved = snapshot.load(state_dir)
    except snapshot.SnapshotError as exc:  # derived data: never trusted over the journal
        log.warning("%s: discarding the snapshot, replaying the journal from its start", exc)
        saved = None
    state = BrokerState.from_snapshot(saved, now) if saved else BrokerState()
    journal_end = store.next_seq(ACTION_SUBJECT)
    if state.journal_seq > journal_end and not ahead_ok:
        # Kept, such a snapshot would look valid once the journal grew past it with other entries.
        kept = snapshot.keep_within(state_dir, journal_end, lambda seq: journal_retained(store, seq))
        log.warning(
            "the snapshot covers the journal up to sequence %d but the journal holds %d entries: discarding "
            "the snapshot, replaying the journal from %s",
            state.journal_seq,
            journal_end,
            "its start" if kept is None else f"the older snapshot's sequence {kept.journal_seq}",
        )
        state = BrokerState() if kept is None else BrokerState.from_snapshot(kept.data, now)
    first = store.first_seq(ACTION_SUBJECT)
    if state.journal_seq < first:
        log.error(
            "the journal before sequence %d was removed by retention but the snapshot covers only "
            "up to %d: consumer positions may go back",
            first,
            state.journal_seq,
        )
    return state


def journal_retained(store: LogStore, seq: int) -> bool:
    """The journal from sequence `seq` on is all in the log (retention removed none of it): a state
    covering the entries before `seq` can be brought forward by replaying it."""
    if seq >= store.next_seq(ACTION_SUBJECT):
        return True
    found = store.entries(ACTION_SUBJECT, seq, 1)
    return bool(found) and found[0] is not None and found[0].offset >= store.start_offset


def replay(store: LogStore, state: BrokerState, now: float, upto: int | None = None) -> int:
    """Apply the journal records after `state.journal_seq` (those ending at or before log offset
    `upto`, if given: a replica applies only what is durable); how many entries."""
    seq, replayed = state.journal_seq, 0
    while True:
        result = store.read(ACTION_SUBJECT, seq, REPLAY_BATCH)
        for record in result.records:
            if upto is not None and record.end > upto:  # not durable yet: applied next time
                state.journal_seq = record.seq
                return replayed
            for entry in journal.decode(record.payload):
                state.apply(entry, now)
                replayed += 1
        if result.next_seq == seq:
            break
        seq = result.next_seq
    state.journal_seq = seq
    return replayed
