"""The relay (`qmq relay`) as a real process against real PostgreSQL (SQLite where stated) and real
brokers: it ships what the app could not, survives SIGKILLs of the app and of itself, a broker that
is down and a database that drops its connections, and never ships a row twice while healthy."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

import qmq
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.outbox import rows
from qmq.outbox.relay import HOUSEKEEPING_INTERVAL_S, HOUSEKEEPING_MAX_SHARE, housekeeping_pause_s
from qmq.outbox.schema import outbox
from tests.support.broker import ROOT, start_broker
from tests.support.databases import fresh_database, set_connections_allowed
from tests.support.delay import start_delay_server
from tests.support.outbox import consume, outbox_rows, relay_args, start_relay, states, wait_for
from tests.support.processes import free_port
from tests.test_meta import log_text

FLAG_AFTER_S, FLAG_ATTEMPTS = 600.0, 10  # the relay's flagging settings in the housekeeping tests
LATE_STOP_SLACK_S = 6.0  # the stop's own work on a loaded machine; a send thread holds it 10 s or more
LEASE_S = 30.0  # the lease the takes of these tests run under


@pytest.fixture
def db_url(pg_url):
    with fresh_database(pg_url) as url:
        upgrade(url)
        yield url


def leave_for_relay(engine, subject: str, count: int) -> list[str]:
    """Commit `count` messages that no in-process sender will ship (as after a crash)."""
    producer = qmq.Producer(brokers=["127.0.0.1:1"], engine=engine, after_commit=False)
    ids = [producer.send_now(subject, {"n": n}) for n in range(count)]
    producer.close()
    return ids


def all_sent(engine, ids: list[str]) -> bool:
    current = states(engine)
    return all(current.get(i) == "sent" for i in ids)


APP = textwrap.dedent("""
    import os, signal, sys
    import sqlalchemy as sa
    import qmq
    from qmq.db.engine import create_engine

    engine = create_engine(sys.argv[1])
    producer = qmq.Producer(brokers=[sys.argv[2]], engine=engine, insert_lease_s=1.0)
    # The process dies at the very moment the commit hands the message to the sender.
    producer.handoff = lambda shipments: os.kill(os.getpid(), signal.SIGKILL)

    @qmq.transactional(producer)
    def place_order(session):
        message_id = producer.send("order.created", {"id": 7})
        print(message_id, flush=True)

    place_order()
""")


def test_an_app_killed_right_after_commit_has_its_message_shipped_by_the_relay(
    processes, engine, db_url, broker
) -> None:
    app = subprocess.run(
        [sys.executable, "-c", APP, db_url, broker.address], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert app.returncode == -signal.SIGKILL, app.stderr
    message_id = app.stdout.strip()
    assert states(engine) == {message_id: "pending"}  # committed, never shipped

    start_relay(processes, db_url, broker=broker.address)
    [delivery] = consume(broker.address, "order.created", 1)
    assert (delivery.id, delivery.body) == (message_id, {"id": 7})  # the id made before the commit
    wait_for(lambda: all_sent(engine, [message_id]), "row marked sent")


def test_a_broker_down_at_commit_time_gets_the_message_when_it_is_back(processes, engine, db_url, tmp_path) -> None:
    port = free_port()
    producer = qmq.Producer(brokers=[f"127.0.0.1:{port}"], engine=engine)
    message_id = producer.send_now("payment.captured", "42 EUR")  # its own transaction: commits fine
    assert producer.flush(20)
    producer.close()
    assert outbox_rows(engine)[message_id].state == "pending"

    start_relay(processes, db_url, broker=f"127.0.0.1:{port}")
    wait_for(lambda: outbox_rows(engine)[message_id].attempts >= 2, "the relay tried and failed too")
    broker = start_broker(processes, tmp_path / "broker", port=port)
    assert [d.id for d in consume(broker.address, "payment.captured", 1)] == [message_id]
    wait_for(lambda: all_sent(engine, [message_id]), "row marked sent")


def test_the_relay_recovers_when_its_database_connections_are_killed(processes, engine, db_url, broker) -> None:
    relay = start_relay(processes, db_url, broker=broker.address)
    first = leave_for_relay(engine, "order.created", 5)
    wait_for(lambda: all_sent(engine, first), "first rows shipped")

    set_connections_allowed(db_url, False)  # every connection of the relay (LISTEN included) is killed
    wait_for(lambda: "database" in log_text(relay) and "retrying" in log_text(relay), "the relay noticed")
    set_connections_allowed(db_url, True)

    later = leave_for_relay(engine, "order.created", 5)
    wait_for(lambda: all_sent(engine, later), "rows committed after the outage shipped")
    assert sorted(d.id for d in consume(broker.address, "order.created", 10)) == sorted(first + later)
    assert relay.poll() is None


def test_two_relays_never_ship_a_row_twice(processes, engine, db_url, broker) -> None:
    ids = leave_for_relay(engine, "order.created", 2000)
    for name in ("relay-a", "relay-b"):
        start_relay(processes, db_url, broker=broker.address, name=name, batch=50, concurrency=2)
    wait_for(lambda: all_sent(engine, ids), "every row shipped", deadline_s=60)
    delivered = consume(broker.address, "order.created", len(ids))
    assert len(delivered) == len(ids)  # no copies
    assert {d.id for d in delivered} == set(ids)


class BlackHole:
    """A TCP server that accepts connections and never answers: a broker hung mid-request."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


def locked_by_another(engine) -> int:
    """How many outbox rows another transaction holds (a shipper's batch in flight). It looks only
    while another session sits in a transaction, its batch taken: the look locks the free rows for a
    moment, and a relay's take that ran meanwhile would skip them and take a part of the batch."""
    with engine.connect() as conn:
        if not conn.execute(IN_A_TRANSACTION).scalar_one():
            conn.rollback()
            return 0
        free = conn.execute(sa.select(outbox.c.id).with_for_update(skip_locked=True)).all()
        total = conn.execute(sa.select(sa.func.count()).select_from(outbox)).scalar_one()
        conn.rollback()
    return total - len(free)


IN_A_TRANSACTION = sa.text(
    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
    " AND state LIKE 'idle in transaction%'"
)


def test_a_relay_killed_mid_batch_loses_its_rows_to_another_after_the_lease(processes, engine, db_url, broker) -> None:
    ids = leave_for_relay(engine, "order.created", 20)
    hole = BlackHole()
    try:
        stuck = start_relay(processes, db_url, broker=f"127.0.0.1:{hole.port}", name="relay-stuck", lease=3)
        wait_for(lambda: locked_by_another(engine) == len(ids), "the batch taken")
        processes.kill(stuck)  # SIGKILL while the batch is in flight
    finally:
        hole.close()
    assert set(states(engine).values()) == {"pending"}

    start_relay(processes, db_url, broker=broker.address, name="relay-b")
    wait_for(lambda: all_sent(engine, ids), "rows reclaimed after the lease and shipped")
    delivered = consume(broker.address, "order.created", len(ids))
    assert sorted(d.id for d in delivered) == sorted(ids)


def test_a_relay_hung_on_a_broker_loses_its_rows_to_another_after_the_lease(processes, engine, db_url, broker) -> None:
    """Not killed: its send never returns. The server ends its transaction after the lease, so the
    rows are pending again for another relay, and the hung one can never mark them."""
    ids = leave_for_relay(engine, "order.created", 20)
    hole = BlackHole()
    try:
        # The batch is seen held only within the lease (the server then ends the transaction, and the
        # hung relay takes nothing more while its send hangs): 4 s; the 2 s before were missed once in CI.
        hung = start_relay(
            processes, db_url, broker=f"127.0.0.1:{hole.port}", name="relay-hung", lease=4, concurrency=1
        )
        wait_for(lambda: locked_by_another(engine) == len(ids), "the batch taken")
        # well before the client's own 10 s send timeout would end the batch
        wait_for(lambda: locked_by_another(engine) == 0, "the rows freed after the lease", deadline_s=8)
        assert set(states(engine).values()) == {"pending"}
        start_relay(processes, db_url, broker=broker.address, name="relay-b")
        wait_for(lambda: all_sent(engine, ids), "rows shipped by the other relay")
        assert hung.poll() is None  # still alive, still hung on its broker
    finally:
        hole.close()
    delivered = consume(broker.address, "order.created", len(ids))
    assert sorted(d.id for d in delivered) == sorted(ids)


def test_sigterm_stops_a_relay_hung_on_a_broker_soon_after_its_lease(processes, engine, db_url) -> None:
    """Its batches cannot finish (their sends never come back), and the sends of a batch of several
    requests run on threads that the interpreter's exit would wait for: the relay still stops one
    lease after SIGTERM (the rows go back to pending when its connections close)."""
    leave_for_relay(engine, "order.created", 600)  # a batch of several sends: the client's send threads
    hole = BlackHole()
    try:
        hung = start_relay(processes, db_url, broker=f"127.0.0.1:{hole.port}", name="relay-hung", lease=2)
        wait_for(lambda: locked_by_another(engine) > 0, "a batch taken")
        stopped_at = time.monotonic()
        assert processes.kill(hung, signal.SIGTERM) == 0
        took_s = time.monotonic() - stopped_at
        assert took_s < 2 + LATE_STOP_SLACK_S, f"stopped {took_s:.1f} s after SIGTERM"
        assert "exiting without them" in log_text(hung)
    finally:
        hole.close()
    wait_for(lambda: locked_by_another(engine) == 0, "the rows free again")
    assert set(states(engine).values()) == {"pending"}


def run_once(db_url: str, broker: str, **flags) -> tuple[dict, str]:
    result = subprocess.run(
        [sys.executable, *relay_args(db_url, broker=broker, once=True, **flags)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT), "QMQ_META": "", "QMQ_DB_URL": "", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout), result.stderr


def test_rows_that_keep_failing_are_flagged_logged_and_still_retried(engine, db_url) -> None:
    [message_id] = leave_for_relay(engine, "order.created", 1)
    report, log = run_once(db_url, f"127.0.0.1:{free_port()}", **{"flag-attempts": 1})
    assert (report["shipped"], report["failed"], report["flagged"], report["pending"]) == (0, 1, 1, 1)
    assert message_id in log and "not shipped after 1 attempts" in log
    row = outbox_rows(engine)[message_id]
    assert row.flagged_at is not None and row.state == "pending" and row.next_attempt_at > row.created_at


def test_sent_rows_are_kept_for_the_audit_window_then_purged_in_batches(engine, db_url, broker) -> None:
    old = leave_for_relay(engine, "order.created", 25)
    recent = leave_for_relay(engine, "order.created", 3)
    report, _ = run_once(db_url, broker.address)
    assert report["shipped"] == 28
    with engine.begin() as conn:  # as if the first rows had been sent 8 days ago
        conn.execute(
            outbox.update()
            .where(outbox.c.message_id.in_(old))
            .values(sent_at=sa.func.now() - sa.text("interval '8 days'"))
        )
    report, _ = run_once(db_url, broker.address, **{"purge-batch": 10, "keep-sent-days": 7})
    assert report["purged"] == 25
    assert set(states(engine)) == set(recent)


def test_sqlite_outbox_is_relayed_by_polling(processes, tmp_path, broker) -> None:
    url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
    upgrade(url)
    engine = create_engine(url)
    ids = leave_for_relay(engine, "order.created", 30)
    start_relay(processes, url, broker=broker.address)
    wait_for(lambda: all_sent(engine, ids), "rows shipped from SQLite")
    assert sorted(d.id for d in consume(broker.address, "order.created", 30)) == sorted(ids)
    engine.dispose()


def test_sigterm_stops_the_relay_cleanly(processes, db_url, broker) -> None:
    relay = start_relay(processes, db_url, broker=broker.address)
    wait_for(lambda: "relaying" in log_text(relay), "the relay started")
    assert processes.kill(relay, signal.SIGTERM) == 0
    assert "relay stopping" in log_text(relay)


def test_notify_wakes_the_relay_long_before_its_poll_interval(processes, engine, db_url, broker) -> None:
    relay = start_relay(processes, db_url, broker=broker.address, **{"poll-interval": 60})
    wait_for(lambda: "LISTEN/NOTIFY" in log_text(relay), "the relay listens")
    ids = leave_for_relay(engine, "order.created", 3)
    wait_for(lambda: all_sent(engine, ids), "shipped on NOTIFY", deadline_s=15)


def test_a_delayed_row_goes_through_the_delay_server(processes, engine, db_url, broker, tmp_path) -> None:
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    producer = qmq.Producer(brokers=["127.0.0.1:1"], engine=engine, after_commit=False)
    message_id = producer.send_now("review.requested", "a week after checkout (here: 2 s)", delay=2)
    due = outbox_rows(engine)[message_id].deliver_at
    producer.close()
    processes.start(
        [*relay_args(db_url, broker=broker.address), "--delay-server", delay.address],
        name="relay",
        env={"PYTHONPATH": str(ROOT), "QMQ_TOKEN": "", "QMQ_META": "", "QMQ_DB_URL": ""},
    )
    [delivery] = consume(broker.address, "review.requested", 1)
    assert delivery.id == message_id and delivery.stored_at >= due.replace(microsecond=due.microsecond // 1000 * 1000)


def add_pending(engine, *given: dict) -> None:
    """Pending rows as a relay finds them, each with its `next_attempt_at` and maybe a lease or a key."""
    defaults = {"subject": "s", "body": b"{}", "content_type": "application/json"}
    defaults |= {"lease_expires_at": None, "order_key": None}  # every row names every column (executemany)
    if any("created_at" in r for r in given):
        defaults["created_at"] = datetime.now(UTC)
    with engine.begin() as conn:
        conn.execute(outbox.insert(), [{**defaults, "message_id": str(uuid.uuid4()), **r} for r in given])


@pytest.fixture(params=["postgresql", "sqlite"])
def any_engine(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'app.sqlite3'}"
        upgrade(url)
        engine = create_engine(url)
        yield engine
        engine.dispose()
    else:
        yield request.getfixturevalue("engine")


def test_the_relay_sleeps_until_the_soonest_row_or_its_lease_is_due(any_engine) -> None:
    def until_due() -> float | None:
        with any_engine.connect() as conn:
            return rows.seconds_until_due(conn)

    now = datetime.now(UTC)
    assert until_due() is None
    add_pending(
        any_engine,
        {"next_attempt_at": now + timedelta(seconds=60)},
        {"next_attempt_at": now - timedelta(seconds=1), "lease_expires_at": now + timedelta(seconds=30)},
        {"next_attempt_at": now - timedelta(seconds=100), "order_key": "k"},  # ordered: the relay's other pass
    )
    assert 25 < until_due() <= 30  # the lease, not the earlier attempt time under it
    add_pending(any_engine, {"next_attempt_at": now + timedelta(seconds=10)})
    assert 5 < until_due() <= 10
    add_pending(any_engine, {"next_attempt_at": now - timedelta(seconds=5)})
    assert until_due() <= -4


def test_the_relay_looks_at_a_bounded_number_of_rows_to_know_how_long_to_sleep(engine) -> None:
    """With a backlog that is not due yet (after a broker outage), the look of every idle shipping
    thread read every pending row: a scan of the whole backlog per look."""
    later = datetime.now(UTC) + timedelta(seconds=60)
    add_pending(engine, *({"next_attempt_at": later + timedelta(milliseconds=i)} for i in range(5000)))
    with engine.connect() as conn:
        conn.exec_driver_sql("ANALYZE qmq_outbox")
        statement = rows.until_due_statement("postgresql").compile(engine, compile_kwargs={"literal_binds": True})
        [[plan]] = conn.exec_driver_sql(f"EXPLAIN (ANALYZE, FORMAT JSON) {statement}").one()
    read = sum(
        node.get("Actual Rows", 0) for node in plan_nodes(plan["Plan"]) if node.get("Relation Name") == "qmq_outbox"
    )
    assert 0 < read <= rows.DUE_LOOKAHEAD_ROWS, json.dumps(plan, indent=1)


def test_the_takes_are_planned_for_the_table_as_it_is_not_as_it_was_when_first_prepared(engine) -> None:
    """The sender and the relay hold their connections for hours. When psycopg prepared their takes,
    PostgreSQL's generic plan of `take_leased`, made while the table was small, read the whole table
    (a sequential scan) and stayed cached until the table was next analyzed: in bench/outbox.py the
    sender's take of one row cost 1 ms after 10 s, and commit to stored p99 went from 3 to 7 ms. The
    takes are not prepared (qmq/outbox/rows.py): each is planned for the table as it is."""
    plans: list[str] = []
    with engine.connect() as conn:
        conn.exec_driver_sql("LOAD 'auto_explain'")  # each statement's plan, as run, sent as a notice
        conn.exec_driver_sql("SET auto_explain.log_min_duration = 0; SET client_min_messages = log")
        conn.commit()
        conn.connection.dbapi_connection.add_notice_handler(lambda notice: plans.append(notice.message_primary))
        for _ in range(10):  # the table empty: were they prepared, PostgreSQL would now use a generic plan
            with conn.begin():
                rows.take_leased(conn, [str(uuid.uuid4())], "sender", LEASE_S)
                rows.take_due(conn, 10, LEASE_S)
        lease = datetime.now(UTC) + timedelta(minutes=5)
        leased = [{"message_id": str(uuid.uuid4()), "lease_token": "sender", "lease_expires_at": lease}]
        add_pending(engine, *leased)
        add_pending(engine, *({"next_attempt_at": datetime.now(UTC)} for _ in range(5000)))
        plans.clear()
        with conn.begin():
            assert rows.take_leased(conn, [leased[0]["message_id"]], "sender", LEASE_S) == {leased[0]["message_id"]}
            assert len(rows.take_due(conn, 10, LEASE_S)) == 10
    takes = [plan for plan in plans if "UPDATE qmq_outbox" in plan]
    assert len(takes) == 2, plans
    for plan in takes:
        assert "Seq Scan" not in plan, plan


def test_a_shipping_transaction_sets_its_settings_for_itself_and_leaves_the_session_as_it_was(engine) -> None:
    """A take (and ordered shipping, by `rows.set_local_settings`) makes its own transaction end when
    left idle longer than the lease, and commit without waiting for the WAL flush; the session, which
    is the application's (or PgBouncer's, shared with every client), keeps its defaults."""
    lease = datetime.now(UTC) + timedelta(minutes=5)
    leased = {"message_id": str(uuid.uuid4()), "lease_token": "sender", "lease_expires_at": lease}
    add_pending(engine, leased)
    add_pending(engine, {"next_attempt_at": datetime.now(UTC)})
    takes = {
        "take_leased": lambda conn: rows.take_leased(conn, [leased["message_id"]], "sender", 12.5),
        "take_due": lambda conn: rows.take_due(conn, 10, 12.5),
        "set_local_settings": lambda conn: rows.set_local_settings(conn, 12.5) or True,
    }

    def settings(conn) -> tuple[str, str]:
        return (
            conn.exec_driver_sql("SHOW synchronous_commit").scalar(),
            conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar(),
        )

    with engine.connect() as conn:
        for name, take in takes.items():
            with conn.begin():
                assert take(conn), name  # a row taken (or the settings set)
                assert settings(conn) == ("off", "12500ms"), name
            assert settings(conn) == ("on", "0"), name
            conn.rollback()  # the SHOWs began a transaction


def plan_nodes(node: dict):
    yield node
    for child in node.get("Plans", ()):
        yield from plan_nodes(child)


@pytest.mark.parametrize(
    ("row", "flagged"),
    [
        ({"created_at": "now"}, False),
        ({"created_at": "now", "attempts": FLAG_ATTEMPTS - 1}, False),
        ({"created_at": "now", "attempts": FLAG_ATTEMPTS}, True),
        ({"created_at": "old"}, True),
        ({"created_at": "almost old"}, False),
    ],
)
def test_housekeeping_flags_without_a_second_scan_only_when_nothing_can_be_due(any_engine, row, flagged) -> None:
    """The backlog's one scan tells whether flagging could find a row; when it says no, flagging (a
    second scan of every pending row) would have found none."""
    now = datetime.now(UTC)
    created = {
        "now": now,
        "old": now - timedelta(seconds=FLAG_AFTER_S + 5),
        "almost old": now - timedelta(seconds=FLAG_AFTER_S - 5),
    }
    add_pending(any_engine, {"next_attempt_at": now, "attempts": 0, **row, "created_at": created[row["created_at"]]})
    with any_engine.begin() as conn:
        backlog = rows.backlog(conn)
        found = rows.flag_overdue(conn, FLAG_AFTER_S, FLAG_ATTEMPTS)
    assert backlog.pending == 1 and backlog.flagged == 0
    assert bool(found) is flagged
    assert backlog.may_need_flagging(FLAG_AFTER_S, FLAG_ATTEMPTS) is flagged


def test_a_slow_housekeeping_pass_waits_longer_so_it_takes_at_most_its_share() -> None:
    assert housekeeping_pause_s(0.05) == HOUSEKEEPING_INTERVAL_S
    for took_s in (1.0, 4.0):  # a backlog of a million rows: seconds of scans per pass
        pause_s = housekeeping_pause_s(took_s)
        assert pause_s > HOUSEKEEPING_INTERVAL_S
        assert took_s / (took_s + pause_s) == pytest.approx(HOUSEKEEPING_MAX_SHARE)
