"""The whole path under fault after fault, with real processes, SIGKILL and SIGSTOP: application
threads commit orders, each with a message, through `qmq.Producer` (the outbox row in the order's
transaction, the after-commit sender); a `qmq relay` ships what the sender left; two `qmq worker`
processes handle each message with SQL idempotency, the effect written in the handler's transaction
(tests/apps/recorder.py); one order in ten fails its first handling and is retried through the
broker, so retries are pending at every fault. The broker group is replicated under two meta servers
(tests/support/chaos.py), and besides its faults a worker and the relay are SIGKILLed and started
again, and the application's database goes away for a few seconds (every connection killed, none
taken: to its clients a PostgreSQL restart). Promised (docs/outbox.md, docs/worker.md): every
committed order's message is handled exactly once (one `worker_handled` row), nothing is handled
that was not committed, and every outbox row ends sent. What committed is what the database holds:
a transaction cut off by the outage may have committed without its caller knowing.

CI runs each fault once; `pytest -m soak tests/test_pipeline_chaos.py` runs twenty drawn at random
(`QMQ_CHAOS_SEED` repeats a draw)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest
import sqlalchemy as sa

import qmq
from tests.support import chaos
from tests.support.broker import ROOT
from tests.support.databases import fresh_database, set_connections_allowed
from tests.support.outbox import relay_args, states
from tests.support.replication import wait_for
from tests.support.waiting import wait_until
from tests.support.worker import app_database, handled, handled_count, start_worker

SUBJECT = "work"  # the recorder app's
APP_THREADS = 2
PROGRESS = 50  # messages handled after a round before the next one starts
DRAIN_TIMEOUT_S = 180.0
RELAY_CATCH_UP_S = 60.0  # the relay's longest back-off after a database error (30 s), and some
SOAK_ROUNDS = 20
# The broker holds a killed worker's messages this long before it gives them to another (60 s by
# default): the drain at the end must not wait a minute.
CONSUMER_TIMEOUT_S = 6
DATABASE_OUTAGE_S = 3.0  # how long the database stays away
# The handler's retries (0.2 s doubling) must outlast an outage, or its messages would go dead.
WORKER_MAX_RETRIES = "20"
RETRY_PAUSE_S = 0.05  # an application thread whose transaction failed tries a new one after this
# One order in this many fails its first handling: a retry through the broker is pending at any moment,
# and every fault meets some.
FAILING_EVERY = 10
LOOKED_UP = 3  # messages never handled whose life a failure prints
ADMIN_TIMEOUT_S = 30


class Application(threading.Thread):
    """Commits orders until stopped: each transaction sends an order's message (one in FAILING_EVERY
    fails its first handling) and inserts the order with the message's id. A transaction the
    database refused (it went away) is not retried: the next order is tried in a new one."""

    def __init__(self, producer: qmq.Producer, engine: sa.Engine, first: int) -> None:
        super().__init__(daemon=True, name=f"app-{first}")
        self.producer, self.engine = producer, engine
        self.next_order = first
        self.stopping = threading.Event()
        self.committed: set[str] = set()  # the commit returned
        self.refused = 0  # transactions the database refused or cut off
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                order = self.next_order
                self.next_order += APP_THREADS
                try:
                    with self.engine.begin() as conn:
                        body = {"order": order, "fail_times": 1 if order % FAILING_EVERY == 0 else 0}
                        message_id = self.producer.send(SUBJECT, body, connection=conn)
                        conn.execute(ORDER_INSERT, {"id": order, "message_id": message_id})
                except sa.exc.OperationalError:
                    self.refused += 1
                    self.stopping.wait(RETRY_PAUSE_S)
                    continue
                self.committed.add(message_id)
        except BaseException as exc:  # reported by the test
            self.error = exc


class Pipeline(chaos.Pipeline):
    """The group, and the recorder app's workers and the relay on it."""

    def start_worker(self, name: str) -> None:
        self.workers[name] = start_worker(
            self.processes,
            [],
            self.db_url,
            name=name,
            env={
                "QMQ_TEST_META": self.cluster.meta,
                "QMQ_TEST_IDEMPOTENT": "sql",
                "QMQ_TEST_MAX_RETRIES": WORKER_MAX_RETRIES,
            },
        )

    def start_relay(self) -> None:
        self.restarts += 1
        self.relay = self.processes.start(
            relay_args(self.db_url, meta=self.cluster.meta),
            name=f"relay-{self.restarts}",
            env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": "", "QMQ_DB_URL": ""},
        )


def the_database_goes_away(pipeline: Pipeline) -> None:
    """The application's database kills every connection and takes none for DATABASE_OUTAGE_S: the
    application's transactions fail, the after-commit sender leaves its rows to the relay, the relay
    and the workers' handlers wait for it (the meta servers have a database of their own)."""
    set_connections_allowed(pipeline.db_url, False)
    try:
        time.sleep(DATABASE_OUTAGE_S)  # the outage itself: nothing to wait for
    finally:
        set_connections_allowed(pipeline.db_url, True)


FAULTS = (*map(chaos.on_the_group, chaos.FAULTS), chaos.kill_a_worker, chaos.kill_the_relay, the_database_goes_away)
ORDER_INSERT = sa.text("INSERT INTO chaos_orders (id, message_id) VALUES (:id, :message_id)")


def committed_orders(engine: sa.Engine, failing: bool = False) -> set[str]:
    """The message ids of the orders the database holds: what committed (`failing`: only the orders
    whose first handling fails)."""
    where = f" WHERE id % {FAILING_EVERY} = 0" if failing else ""
    with engine.connect() as conn:
        return set(conn.execute(sa.text(f"SELECT message_id FROM chaos_orders{where}")).scalars())


def admin(meta: str, *args: str) -> str:
    """What `qmq admin ARGS` prints about the cluster: a failure's explanation."""
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "admin", *args, "--meta", meta],
        capture_output=True,
        text=True,
        timeout=ADMIN_TIMEOUT_S,
        env={**os.environ, "QMQ_TOKEN": ""},
    )
    return f"$ qmq admin {' '.join(args)}\n{done.stdout}{done.stderr}"


def faults_in_a_row(processes, tmp_path, pg_url, faults) -> None:
    with (
        app_database(pg_url) as db_url,
        fresh_database(pg_url) as meta_db_url,
        contextlib.ExitStack() as stack,
    ):
        engine = sa.create_engine(db_url.replace("postgresql://", "postgresql+psycopg://"), pool_size=APP_THREADS + 2)
        stack.callback(engine.dispose)
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE chaos_orders (id BIGINT PRIMARY KEY, message_id TEXT NOT NULL)"))
        cluster = chaos.start_cluster(processes, tmp_path, meta_db_url, "--consumer-timeout", str(CONSUMER_TIMEOUT_S))
        pipeline = Pipeline(cluster, processes, db_url)
        for name in ("w1", "w2"):
            pipeline.start_worker(name)
        pipeline.start_relay()
        producer = qmq.Producer(meta=cluster.meta, engine=engine)
        stack.callback(producer.close)
        apps = [Application(producer, engine, first) for first in range(APP_THREADS)]
        for app in apps:
            app.start()
            stack.callback(app.stopping.set)  # a failed round ends them too
        wait_for(lambda: handled_count(db_url) >= PROGRESS, "the workers to get going")

        def apps_fine(n: int) -> None:
            assert all(app.error is None for app in apps), [app.error for app in apps]

        chaos.rounds(pipeline, faults, lambda: handled_count(db_url), PROGRESS, after_each=apps_fine)

        for app in apps:
            app.stopping.set()
            app.join(timeout=60)
            assert not app.is_alive() and app.error is None, app.error
        committed = committed_orders(engine)
        returned = set().union(*(app.committed for app in apps))
        assert returned <= committed, f"{len(returned - committed)} commits that returned are not in the database"

        def all_handled() -> bool:
            return {row[0] for row in handled(db_url)} >= committed

        def unhandled() -> str:
            missing = sorted(committed - {row[0] for row in handled(db_url)})
            looked_up = [admin(cluster.meta, "lookup", "--id", message_id) for message_id in missing[:LOOKED_UP]]
            return "\n".join(
                [f"{len(missing)} never handled, for example {missing[:10]}", *looked_up, admin(cluster.meta, "stats")]
            )

        wait_until(
            all_handled, f"all {len(committed):,} committed messages handled", DRAIN_TIMEOUT_S, explain=unhandled
        )
        effects = [row[0] for row in handled(db_url)]
        twice = len(effects) - len(set(effects))
        assert twice == 0, f"{twice} messages handled twice"
        assert set(effects) <= committed, f"{len(set(effects) - committed)} handled messages were never committed"
        first_tries = {message_id for message_id, attempts, _ in handled(db_url) if attempts == 1}
        assert not first_tries & committed_orders(engine, failing=True), "a failing handling was not retried"

        # A row whose send went through but whose mark did not (the database went away between the
        # two) stays pending until the relay, backing off from the outage, ships it again and marks it.
        def unsent() -> str:
            rows = {message_id: state for message_id, state in states(engine).items() if state != "sent"}
            return f"{len(rows)} rows not sent, for example {sorted(rows.items())[:10]}"

        wait_until(
            lambda: all(state == "sent" for state in states(engine).values()),
            "every outbox row marked sent (the relay ships again what an outage left pending)",
            RELAY_CATCH_UP_S,
            explain=unsent,
        )
        refused = sum(app.refused for app in apps)
        print(f"{len(faults)} faults: {len(committed):,} orders committed, each handled once ({refused} refused)")


def test_each_fault_on_the_whole_path_leaves_every_order_handled_once(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, FAULTS)


@pytest.mark.soak
@pytest.mark.timeout(3600)
def test_random_faults_on_the_whole_path_leave_every_order_handled_once(processes, tmp_path, pg_url) -> None:
    faults_in_a_row(processes, tmp_path, pg_url, chaos.drawn(FAULTS, SOAK_ROUNDS))
