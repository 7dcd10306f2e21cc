"""Ordered messages end to end (docs/ordering.md), with real PostgreSQL, a real meta server, brokers,
relays, application processes and workers: a key's messages are handled in outbox order, one at a
time, across a worker's crash and while a worker joins. Poison messages and stopped workers:
tests/test_ordering_faults.py; the full-size run: tests/test_ordering_soak.py."""

from __future__ import annotations

from tests.support.ordering import (
    DEADLINE_S,
    handled_count,
    order_problems,
    ordered_database,
    rows,
    start_cluster,
    start_ordered_worker,
    start_producer,
    start_relay,
    wait_done,
)
from tests.test_meta import log_text, wait_until


def test_keys_are_handled_in_outbox_order_through_crashes_and_a_joining_worker(processes, tmp_path, pg_url) -> None:
    keys = [f"order-{i}" for i in range(40)]
    rounds = 25  # per application process: 50 messages per key from the two
    total = len(keys) * rounds * 2
    gate = tmp_path / "second-half"
    with ordered_database(pg_url, keys) as db:
        meta, _brokers = start_cluster(processes, tmp_path, ["g1", "g2"])
        relays = [start_relay(processes, db, meta, f"relay-{i}") for i in range(2)]
        first = start_ordered_worker(processes, meta, db, "w1")
        producers = [
            start_producer(
                processes,
                db,
                meta,
                rounds,
                keys,
                f"app-{i}",
                QMQ_TEST_ROUND_PAUSE_S="0.2",
                QMQ_TEST_GATE_FILE=str(gate),
            )
            for i in range(2)
        ]
        wait_until(lambda: handled_count(db) >= total // 4, "a quarter handled", DEADLINE_S)
        processes.kill(first)  # SIGKILL in the middle of the stream
        start_ordered_worker(processes, meta, db, "w1-again")
        half = len(keys) * (rounds // 2) * 2
        wait_until(lambda: handled_count(db) >= half, "the first half handled", DEADLINE_S)
        second = start_ordered_worker(processes, meta, db, "w2")
        wait_until(
            lambda: "granted [" in log_text(second) and "granted []" not in log_text(second),
            "w2 holds queues",
            DEADLINE_S,
        )
        gate.touch()  # the second half is committed while both workers share the queues
        for producer in producers:
            wait_done(producer)
        wait_until(lambda: handled_count(db) >= total, "every message handled", DEADLINE_S)
        assert order_problems(db, dict.fromkeys(keys, rounds * 2)) == []
        workers = {w for (w,) in rows(db, "SELECT DISTINCT worker FROM ordered_handled")}
        assert workers == {"w1", "w1-again", "w2"}
        assert second.poll() is None and all(r.poll() is None for r in relays)
