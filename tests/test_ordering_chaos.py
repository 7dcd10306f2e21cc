"""Ordered messages under fault after fault, with real processes, SIGKILL and SIGSTOP: an application
process commits each key's next message through the outbox (the key's row locked, docs/ordering.md);
a `qmq relay` ships what the after-commit sender left; two ordered `qmq worker`s hold the logical
queues' leases at the broker and handle one message per key at a time. The queues live on a
replicated broker group under two meta servers (tests/support/chaos.py), which docs/ordering.md tells
users to choose for ordered subjects: the leases, the cursors rewound for a new holder and the
journal must come through a failover. Besides the group's faults, a worker, the relay and the
application are SIGKILLed and started again. Promised: every key's committed messages handled 1..n
in order, once each, and the handler never called for a message before an earlier one of its key.

CI runs each fault once; `pytest -m soak tests/test_ordering_chaos.py` runs twenty drawn at random
(`QMQ_CHAOS_SEED` repeats a draw)."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from tests.support import chaos
from tests.support.ordering import (
    TEST_LEASE_S,
    handled_count,
    order_problems,
    ordered_database,
    rows,
    start_ordered_worker,
    start_producer,
    start_relay,
)
from tests.support.replication import wait_for

KEYS = [f"key-{i}" for i in range(12)]
ROUND_PAUSE_S = "0.02"  # between the application's rounds (one message per key each): a steady stream
PROGRESS = 30  # handlings after a round before the next one starts
# ...within this of the group being whole again. A client's cached route lives 30 s: workers that held
# no queue after a master's loss asked the old address for leases until it expired (26 - 30 s).
RESUMED_WITHIN_S = 15.0
DRAIN_TIMEOUT_S = 180.0
SOAK_ROUNDS = 20


class OrderedPipeline(chaos.Pipeline):
    """The group, and the ordered test app's workers, the relay and the application on it."""

    app: Any = None

    def start_worker(self, name: str) -> None:
        self.workers[name] = start_ordered_worker(self.processes, self.cluster.meta, self.db_url, name)

    def start_relay(self) -> None:
        self.restarts += 1
        self.relay = start_relay(self.processes, self.db_url, self.cluster.meta, f"relay-{self.restarts}")

    def start_app(self) -> None:
        self.restarts += 1
        self.app = start_producer(
            self.processes,
            self.db_url,
            self.cluster.meta,
            1_000_000,  # rounds: it runs until the test kills it
            KEYS,
            f"app-{self.restarts}",
            QMQ_TEST_ROUND_PAUSE_S=ROUND_PAUSE_S,
        )


def kill_the_application(pipeline: OrderedPipeline) -> None:
    """SIGKILL the application mid-stream and start it again: what its sender held waits for the
    relay, behind which the key's later rows wait."""
    pipeline.processes.kill(pipeline.app, signal.SIGKILL)
    pipeline.start_app()


# A master's loss first, while the workers' routes are young: they used to ask its old address for
# leases until the route expired.
GROUP_FAULTS = (chaos.kill_the_master, *(f for f in chaos.FAULTS if f is not chaos.kill_the_master))
FAULTS = (*map(chaos.on_the_group, GROUP_FAULTS), chaos.kill_a_worker, chaos.kill_the_relay, kill_the_application)


def committed(db_url: str) -> dict[str, int]:
    """Each key's committed messages: its sequence in the entity row (taken in the sending transaction)."""
    return dict(rows(db_url, "SELECT order_key, seq FROM ordered_entities"))


def faults_in_a_row(processes, tmp_path, pg_url, faults) -> None:
    with ordered_database(pg_url, KEYS) as db_url:
        cluster = chaos.start_cluster(processes, tmp_path, db_url, "--ordered-lease", str(TEST_LEASE_S))
        pipeline = OrderedPipeline(cluster, processes, db_url)
        for name in ("w1", "w2"):
            pipeline.start_worker(name)
        pipeline.start_relay()
        pipeline.start_app()
        wait_for(lambda: handled_count(db_url) >= PROGRESS, "the workers to get going")

        def in_order(n: int) -> None:
            assert order_problems(db_url, {}) == [], f"round {n}: a key's handler called out of order"

        chaos.rounds(pipeline, faults, lambda: handled_count(db_url), PROGRESS, RESUMED_WITHIN_S, in_order)

        processes.kill(pipeline.app, signal.SIGKILL)  # what it committed is the expected, whatever it held
        expected = committed(db_url)
        total = sum(expected.values())
        wait_for(lambda: handled_count(db_url) >= total, f"all {total:,} committed messages handled", DRAIN_TIMEOUT_S)
        assert order_problems(db_url, expected) == []
        assert handled_count(db_url) == total
        print(f"{len(faults)} faults: {total:,} ordered messages over {len(KEYS)} keys, each handled once, in order")


def test_each_fault_keeps_every_key_in_order(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, FAULTS)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_faults_keep_every_key_in_order(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.drawn(FAULTS, SOAK_ROUNDS))
