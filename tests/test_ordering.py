"""Ordered messages end to end (docs/ordering.md), with real PostgreSQL, a real meta server, brokers,
relays, application processes and workers: a key's messages are handled in outbox order, one at a
time, across crashes and while workers join; a poison message blocks its key only; a stopped worker's
queues move only after its lease expired."""

from __future__ import annotations

import os
import signal

import pytest

from qmq.client import Client, OutgoingMessage
from qmq.client.blocking import Admin
from qmq.protocol.ordering import ORDERED_QUEUES, queue_of, queue_subject
from tests.support.broker import ROOT
from tests.support.ordering import (
    GROUP,
    SUBJECT,
    TEST_LEASE_S,
    handled_by_key,
    order_problems,
    ordered_database,
    rows,
    start_cluster,
    start_ordered_worker,
    start_producer,
)
from tests.support.outbox import relay_args
from tests.test_meta import log_text, wait_until
from worker.ordered_feeder import LOCK_EVERY_S

DEADLINE_S = 60.0


def start_relay(processes, db_url: str, meta: str, name: str):
    return processes.start(
        relay_args(db_url, meta=meta), name=name, env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_DB_URL": ""}
    )


def wait_done(proc) -> None:
    wait_until(lambda: "done" in log_text(proc) or proc.poll() not in (None, 0), "the producer commits", DEADLINE_S)
    assert proc.wait(30) == 0, log_text(proc)[-3000:]


def handled_count(db_url: str) -> int:
    return rows(db_url, "SELECT count(*) FROM ordered_handled")[0][0]


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


def keys_in_one_queue(count: int) -> list[str]:
    """`count` keys that hash to the same logical queue."""
    by_queue: dict[int, list[str]] = {}
    for i in range(10_000):
        key = f"k-{i}"
        same = by_queue.setdefault(queue_of(key), [])
        same.append(key)
        if len(same) == count:
            return same
    raise AssertionError("unreachable")


def send_ordered(meta: str, bodies: list[dict]) -> None:
    with Client(meta=meta) as client:
        results = client.send([OutgoingMessage(SUBJECT, b, order_key=b["key"]) for b in bodies])
    assert all(r.ok for r in results), results


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
                wait_until(lambda: len(_dead(admin, queue)) == 1, "the poison message is a dead letter", DEADLINE_S)
                wait_until(lambda: handled_by_key(db)[poisoned] == [1, 3, 4, 5], "the key goes on", DEADLINE_S)
                calls = rows(db, f"SELECT count(*) FROM ordered_attempts WHERE order_key = '{poisoned}' AND seq = 2")
                assert calls[0][0] == 5  # the first attempt and max_retries=4 more, in place
            else:
                wait_until(lambda: len(_dead(admin, queue)) == 4, "the poison message and 3 parked", DEADLINE_S)
                assert handled_by_key(db)[poisoned] == [1], "the key stopped at its poison message"
                assert rows(db, f"SELECT max(seq) FROM ordered_attempts WHERE order_key = '{poisoned}'")[0][0] == 2
                processes.kill(worker)  # the brokers remember the stopped key, not only the worker
                worker = start_ordered_worker(
                    processes, meta, db, "w1-again", QMQ_TEST_MAX_RETRIES="4", QMQ_TEST_ON_POISON=on_poison
                )
                send_ordered(meta, [{"key": poisoned, "seq": 6}])
                wait_until(lambda: len(_dead(admin, queue)) >= 5, "parked after a restart too", DEADLINE_S)
                assert handled_by_key(db)[poisoned] == [1]
                rows(db, f"INSERT INTO ordered_fixed VALUES ('{poisoned}') RETURNING 1")  # the operator fixes it
                admin.redrive(queue, GROUP)
                wait_until(lambda: handled_by_key(db)[poisoned] == [1, 2, 3, 4, 5, 6], "re-driven in order", DEADLINE_S)
        finally:
            admin.close()
        assert order_problems(db, {k: 20 for k in others}) == []
        assert worker.poll() is None and brokers[0].proc.poll() is None


def _dead(admin: Admin, queue: str) -> list[dict]:
    answers = admin.dead_list(queue, GROUP)
    return [m for answer in answers for m in (answer.reply or {}).get("messages", [])]


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
