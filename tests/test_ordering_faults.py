"""Ordered consumption under faults (docs/ordering.md), with real PostgreSQL, a meta server, brokers
and workers: a poison message blocks its key only (`on_poison` both ways, a stopped key surviving a
worker restart and re-driven in order); a stopped (SIGSTOP) worker's queues move only after its
lease expired, and it runs none of them when it comes back."""

from __future__ import annotations

import os
import signal

import pytest

from qmq.client.blocking import Admin
from qmq.protocol.ordering import ORDERED_QUEUES, queue_of, queue_subject
from tests.support.ordering import (
    DEADLINE_S,
    GROUP,
    SUBJECT,
    TEST_LEASE_S,
    dead_letters,
    handled_by_key,
    handled_count,
    keys_in_one_queue,
    order_problems,
    ordered_database,
    rows,
    send_ordered,
    start_cluster,
    start_ordered_worker,
    start_producer,
    start_relay,
    wait_done,
)
from tests.test_meta import log_text, wait_until
from worker.ordered_feeder import LOCK_EVERY_S


@pytest.mark.parametrize("on_poison", ["dead-letter", "stop"])
def test_a_poison_message_blocks_its_key_only(processes, tmp_path, pg_url, on_poison) -> None:
    poisoned, *others = keys_in_one_queue(3)
    queue = queue_subject(SUBJECT, queue_of(poisoned))
    with ordered_database(pg_url) as db:
        meta, brokers = start_cluster(processes, tmp_path, ["g1"])
        worker = start_ordered_worker(processes, meta, db, "w1", QMQ_TEST_MAX_RETRIES="4", QMQ_TEST_ON_POISON=on_poison)
        bodies = [{"key": poisoned, "seq": s, "poison": s == 2} for s in range(1, 6)]
        for key in others:
            bodies += [{"key": key, "seq": s, "sleep": 0.05} for s in range(1, 21)]
        send_ordered(meta, sorted(bodies, key=lambda b: b["seq"]))  # interleaved, in each key's order
        wait_until(lambda: len(handled_by_key(db)[others[0]]) == 20, "the other keys handled", DEADLINE_S)
        wait_until(lambda: len(handled_by_key(db)[others[1]]) == 20, "the other keys handled", DEADLINE_S)
        attempts = rows(db, f"SELECT at FROM ordered_attempts WHERE order_key = '{poisoned}' AND seq = 2 ORDER BY id")
        first_try = attempts[0][0]
        flowing = rows(
            db,
            f"SELECT count(*) FROM ordered_handled WHERE order_key <> '{poisoned}' AND at > '{first_try.isoformat()}'",
        )[0][0]
        assert flowing >= 10, "the other keys of the queue went on while the poison message was retried"
        admin = Admin(meta=meta)
        try:
            if on_poison == "dead-letter":
                wait_until(
                    lambda: len(dead_letters(admin, queue)) == 1, "the poison message is a dead letter", DEADLINE_S
                )
                wait_until(lambda: handled_by_key(db)[poisoned] == [1, 3, 4, 5], "the key goes on", DEADLINE_S)
                calls = rows(db, f"SELECT count(*) FROM ordered_attempts WHERE order_key = '{poisoned}' AND seq = 2")
                assert calls[0][0] == 5  # the first attempt and max_retries=4 more, in place
            else:
                wait_until(lambda: len(dead_letters(admin, queue)) == 4, "the poison message and 3 parked", DEADLINE_S)
                assert handled_by_key(db)[poisoned] == [1], "the key stopped at its poison message"
                assert rows(db, f"SELECT max(seq) FROM ordered_attempts WHERE order_key = '{poisoned}'")[0][0] == 2
                processes.kill(worker)  # the brokers remember the stopped key, not only the worker
                worker = start_ordered_worker(
                    processes, meta, db, "w1-again", QMQ_TEST_MAX_RETRIES="4", QMQ_TEST_ON_POISON=on_poison
                )
                send_ordered(meta, [{"key": poisoned, "seq": 6}])
                wait_until(lambda: len(dead_letters(admin, queue)) >= 5, "parked after a restart too", DEADLINE_S)
                assert handled_by_key(db)[poisoned] == [1]
                rows(db, f"INSERT INTO ordered_fixed VALUES ('{poisoned}') RETURNING 1")  # the operator fixes it
                admin.redrive(queue, GROUP)
                wait_until(lambda: handled_by_key(db)[poisoned] == [1, 2, 3, 4, 5, 6], "re-driven in order", DEADLINE_S)
        finally:
            admin.close()
        assert order_problems(db, {k: 20 for k in others}) == []
        assert worker.poll() is None and brokers[0].proc.poll() is None


def test_a_stopped_worker_keeps_its_queues_until_its_lease_expired(processes, tmp_path, pg_url) -> None:
    keys = [f"order-{i}" for i in range(20)]
    rounds = 40
    with ordered_database(pg_url, keys) as db:
        meta, _brokers = start_cluster(processes, tmp_path, ["g1"])
        start_relay(processes, db, meta, "relay")
        first = start_ordered_worker(processes, meta, db, "w1")
        second = start_ordered_worker(processes, meta, db, "w2")
        for worker in (first, second):  # "w1" < "w2": w1's share is queues 0-31
            wait_until(lambda w=worker: "holding 32 queues" in log_text(w), "the queues shared", DEADLINE_S)
        firsts = [k for k in keys if queue_of(k) < ORDERED_QUEUES // 2]
        assert firsts and len(firsts) < len(keys)
        producer = start_producer(processes, db, meta, rounds, keys, "app", QMQ_TEST_ROUND_PAUSE_S="0.2")
        handled_by_w1 = "SELECT count(*) FROM ordered_handled WHERE worker = 'w1'"
        wait_until(lambda: rows(db, handled_by_w1)[0][0] >= 40, "w1 handles its queues", DEADLINE_S)
        os.kill(first.pid, signal.SIGSTOP)
        stopped_at = rows(db, "SELECT clock_timestamp()")[0][0]
        in_firsts = "order_key IN (" + ", ".join(f"'{k}'" for k in firsts) + ")"
        taken = f"SELECT min(at), count(*) FROM ordered_handled WHERE worker = 'w2' AND {in_firsts}"
        moved_at, _ = wait_until(lambda: (r := rows(db, taken)[0])[1] >= 20 and r, "w2 takes w1's queues", DEADLINE_S)
        # w1 renewed its leases at most LOCK_EVERY_S before it stopped: they ran until TEST_LEASE_S after that.
        assert (moved_at - stopped_at).total_seconds() >= TEST_LEASE_S - LOCK_EVERY_S - 0.5
        assert "holding 64 queues" in log_text(second)
        os.kill(first.pid, signal.SIGCONT)  # w1 comes back: it must not run the queues it lost
        wait_done(producer)
        try:
            wait_until(lambda: handled_count(db) >= len(keys) * rounds, "every message handled", DEADLINE_S)
        finally:
            print({k: (len(v), queue_of(k)) for k, v in handled_by_key(db).items()})
            print(rows(db, "SELECT order_key, max(seq), count(*) FROM ordered_attempts GROUP BY order_key"))
        assert order_problems(db, dict.fromkeys(keys, rounds)) == []
