"""The full-size ordering run of issue 16 (docs/ordering.md), behind the `soak` marker (minutes):

    .venv/bin/python -m pytest -m soak tests/test_ordering_soak.py -q

200 keys x 250 messages committed by four application processes through the outbox, two relays, two
broker groups; during the run an application process, a relay, a broker and a worker are SIGKILLed
and started again, and a third worker joins half-way. Every key's handlings must have committed
1..250 in order, the handler never called for a message before an earlier one of its key, all 50,000
handled. tests/test_ordering.py runs the bounded form on every CI run.
"""

from __future__ import annotations

import time

import pytest

from tests.support.broker import restart_broker
from tests.support.ordering import (
    handled_count,
    order_problems,
    ordered_database,
    rows,
    start_cluster,
    start_ordered_worker,
    start_producer,
    start_relay,
)
from tests.test_meta import log_text, wait_until

KEYS = 200
PER_KEY = 250
APPS = 4
SOAK_DEADLINE_S = 900.0


@pytest.mark.soak
@pytest.mark.timeout(SOAK_DEADLINE_S * 2)
def test_full_size_ordering_through_every_kind_of_crash(processes, tmp_path, pg_url) -> None:
    keys = [f"order-{i}" for i in range(KEYS)]
    total = KEYS * PER_KEY
    started = time.monotonic()
    with ordered_database(pg_url, keys) as db:
        meta, brokers = start_cluster(processes, tmp_path, ["g1", "g2"])
        relays = [start_relay(processes, db, meta, f"relay-{i}") for i in range(2)]
        workers = [start_ordered_worker(processes, meta, db, f"w{i}") for i in (1, 2)]
        target = {"QMQ_TEST_TARGET": str(PER_KEY)}
        apps = [start_producer(processes, db, meta, 0, keys, f"app-{i}", **target) for i in range(APPS)]

        def at(fraction: float) -> None:
            wait_until(lambda: handled_count(db) >= total * fraction, f"{fraction:.0%} handled", SOAK_DEADLINE_S)
            print(f"{fraction:.0%} handled after {time.monotonic() - started:.0f} s", flush=True)

        at(0.15)
        processes.kill(apps[0])  # an application process dies mid-stream; started again, it carries on
        apps[0] = start_producer(processes, db, meta, 0, keys, "app-0-again", **target)
        at(0.30)
        processes.kill(relays[0])
        relays[0] = start_relay(processes, db, meta, "relay-0-again")
        at(0.45)
        processes.kill(brokers[0].proc)  # a broker group goes down and comes back on its data
        brokers[0] = restart_broker(processes, brokers[0], name="broker-g1-again")
        at(0.50)
        workers.append(start_ordered_worker(processes, meta, db, "w3"))
        at(0.65)
        processes.kill(workers[0])
        workers[0] = start_ordered_worker(processes, meta, db, "w1-again")
        for app in apps:
            wait_until(lambda a=app: "done" in log_text(a), "the applications commit everything", SOAK_DEADLINE_S)
        wait_until(lambda: handled_count(db) >= total, "all 50,000 handled", SOAK_DEADLINE_S)
        print(f"all handled after {time.monotonic() - started:.0f} s", flush=True)
        assert order_problems(db, dict.fromkeys(keys, PER_KEY)) == []
        assert rows(db, "SELECT count(*) FROM ordered_handled")[0][0] == total
        assert {w for (w,) in rows(db, "SELECT DISTINCT worker FROM ordered_handled")} >= {"w1", "w2", "w3"}
