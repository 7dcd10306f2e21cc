"""The broker's consumption state at start: its last snapshot, then the journal after it.

Blocking (it reads the store): run it before serving.
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
    try:
        saved = snapshot.load(state_dir)
    except snapshot.SnapshotError as exc:  # derived data: never trusted over the journal
        log.warning("%s: discarding the snapshot, replaying the journal from its start", exc)
        saved = None
    state = BrokerState.from_snapshot(saved, now) if saved else BrokerState()
    if state.journal_seq > store.next_seq(ACTION_SUBJECT):
        log.warning(
            "the snapshot covers the journal up to sequence %d but the journal holds %d entries: discarding "
            "the snapshot, replaying the journal from its start",
            state.journal_seq,
            store.next_seq(ACTION_SUBJECT),
        )
        state = BrokerState()
    first = store.first_seq(ACTION_SUBJECT)
    if state.journal_seq < first:
        log.error(
            "the journal before sequence %d was removed by retention but the snapshot covers only "
            "up to %d: consumer positions may go back",
            first,
            state.journal_seq,
        )
    seq, replayed = state.journal_seq, 0
    while True:
        result = store.read(ACTION_SUBJECT, seq, REPLAY_BATCH)
        for record in result.records:
            for entry in journal.decode(record.payload):
                state.apply(entry, now)
                replayed += 1
        if result.next_seq == seq:
            break
        seq = result.next_seq
    state.journal_seq = seq
    log.info(
        "consumption state: %d groups, %d pending retries, %d journal entries replayed",
        len(state.groups),
        len(state.retries),
        replayed,
    )
    return state
