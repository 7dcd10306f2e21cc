"""The transactional producer with plain SQLAlchemy sessions, on PostgreSQL and SQLite, against a
real broker: what a transaction commits is delivered, what it rolls back never exists, and the app
never waits for or fails because of a broker."""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import uuid
from datetime import UTC, datetime, timedelta
from decimal import Decimal

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import qmq
from qmq.client.errors import InvalidMessage
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.outbox import rows
from tests.support.databases import fresh_database, set_connections_allowed, sqlite_or_postgres
from tests.support.delay import start_delay_server
from tests.support.outbox import committed_ids, consume, outbox_rows, states
from tests.support.processes import free_port

orders = sa.Table(
    "orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True), sa.Column("item", sa.String(50))
)


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path):
    with sqlite_or_postgres(request.param, request, tmp_path, "app.sqlite3") as url:
        upgrade(url)
        engine = create_engine(url)
        orders.create(engine)
        engine.dispose()
        yield url


@pytest.fixture
def producer(engine, broker):
    producer = qmq.Producer(brokers=[broker.address], engine=engine)
    yield producer
    producer.close()


def order_count(engine) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(orders)).scalar_one()


def test_commit_delivers_and_rollback_never_does(producer, engine, broker) -> None:
    @qmq.transactional(producer)
    def place_order(session: Session, order_id: int, fail: bool = False) -> str:
        session.execute(orders.insert().values(id=order_id, item="book"))
        message_id = producer.send(
            "order.created", {"id": order_id}, key=str(order_id), tags=["new"], headers={"trace": f"t{order_id}"}
        )
        if fail:
            raise RuntimeError("payment declined")
        return message_id

    committed = place_order(order_id=1)
    with pytest.raises(RuntimeError):
        place_order(order_id=2, fail=True)

    assert producer.flush(10)
    assert states(engine) == {committed: "sent"}
    assert order_count(engine) == 1
    [delivery] = consume(broker.address, "order.created", 1)
    assert (delivery.id, delivery.body, delivery.key, delivery.tags) == (committed, {"id": 1}, "1", ("new",))
    assert delivery.content_type == "application/json"
    # The outbox names itself, so that the reconciliation can tell a rolled-back transaction's message.
    assert delivery.headers == {"trace": "t1", "qmq-producer": f"outbox:{engine.url.database}"}


def test_a_savepoint_that_rolls_back_drops_only_its_messages(producer, engine, broker) -> None:
    @qmq.transactional(producer)
    def reserve_seat(session: Session, fail: bool) -> str:
        message_id = producer.send("seat.reserved", f"seat for {fail}")
        if fail:
            raise ValueError("no seat left")
        return message_id

    @qmq.transactional(producer)
    def book_trip(session: Session) -> list[str]:
        ids = [producer.send("trip.booked", b"trip")]
        ids.append(reserve_seat(session=session, fail=False))
        with pytest.raises(ValueError):
            reserve_seat(session=session, fail=True)
        savepoint = session.begin_nested()  # a savepoint of the application's own, rolled back by hand
        ids.append(producer.send("seat.reserved", "manual savepoint"))
        savepoint.rollback()
        return ids

    trip, seat, rolled_back_by_hand = book_trip()
    assert producer.flush(10)
    assert states(engine) == {trip: "sent", seat: "sent"}
    assert [d.id for d in consume(broker.address, "seat.reserved", 1)] == [seat]
    assert rolled_back_by_hand not in outbox_rows(engine)


def test_a_transaction_the_caller_began_is_joined_and_ships_after_its_commit(producer, engine, broker) -> None:
    @qmq.transactional(producer)
    def notify(session: Session, text: str) -> str:
        return producer.send("note", text)

    with Session(engine) as session:
        with session.begin():
            kept = notify(session=session, text="kept")
            assert committed_ids(engine) == set()  # not committed yet: invisible to others
        with pytest.raises(KeyError), session.begin():
            notify(session=session, text="lost")
            raise KeyError("the caller changed its mind")
    assert producer.flush(10)
    assert states(engine) == {kept: "sent"}
    assert [d.body for d in consume(broker.address, "note", 1)] == ["kept"]


def test_send_now_commits_its_row_alone(producer, engine, broker) -> None:
    message_id = producer.send_now("audit.event", "user logged in")
    assert message_id in outbox_rows(engine)  # committed before send returned
    assert producer.flush(10)
    assert states(engine) == {message_id: "sent"}
    assert [d.id for d in consume(broker.address, "audit.event", 1)] == [message_id]


def test_bad_messages_are_refused_in_the_app_and_nothing_is_written(producer, engine) -> None:
    @qmq.transactional(producer)
    def send(session: Session, subject: str, **kwargs) -> None:
        session.execute(orders.insert().values(id=9, item="x"))
        producer.send(subject, "body", **kwargs)

    with pytest.raises(InvalidMessage, match="subject"):
        send(subject="has spaces")
    with pytest.raises(TypeError, match="JSON"):
        producer.send_now("ok.subject", object())
    with pytest.raises(ValueError, match="NaN"):
        producer.send_now("ok.subject", {"price": float("nan")})
    with pytest.raises(InvalidMessage, match="the limit is"):
        producer.send_now("ok.subject", b"x" * (5 * 1024 * 1024))
    with pytest.raises(ValueError, match="730 days"):
        send(subject="order.timeout", delay=800 * 86400)
    with pytest.raises(ValueError, match="timezone"):
        producer.send_now("order.timeout", "x", deliver_at=datetime(2030, 1, 1))
    assert outbox_rows(engine) == {} and order_count(engine) == 0


def test_a_broker_that_is_down_never_fails_the_app(engine, tmp_path, processes) -> None:
    producer = qmq.Producer(brokers=[f"127.0.0.1:{free_port()}"], engine=engine)  # nothing listens there

    @qmq.transactional(producer)
    def place_order(session: Session) -> str:
        session.execute(orders.insert().values(id=1, item="book"))
        return producer.send("order.created", {"id": 1})

    message_id = place_order()
    assert producer.flush(20)
    producer.close()
    row = outbox_rows(engine)[message_id]
    assert order_count(engine) == 1
    # Given back to the relay at once, with the error and a backoff, instead of waiting out a lease.
    assert (row.state, row.attempts, row.lease_token) == ("pending", 1, None)
    assert "refused" in row.last_error.lower() or "connect" in row.last_error.lower()


def test_a_full_sender_leaves_rows_for_the_relay(engine, broker) -> None:
    producer = qmq.Producer(brokers=[broker.address], engine=engine, after_commit=False)
    message_id = producer.send_now("order.created", "for the relay")
    row = outbox_rows(engine)[message_id]
    assert (row.state, row.lease_token) == ("pending", None)  # no lease: any relay may ship it now
    producer.close()


def test_threads_that_send_first_at_once_share_one_sender(engine, broker) -> None:
    """Rows are leased to the sender's token: a second sender, made by a racing thread and then
    dropped, would lease rows that no one ships until the relay finds them."""
    threads = 8
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter allows
    try:
        for _ in range(20):
            producer = qmq.Producer(brokers=[broker.address], engine=engine)
            barrier = threading.Barrier(threads)

            def first_send(_: int, producer=producer, barrier=barrier) -> int:
                barrier.wait()
                return id(producer.sender)

            with concurrent.futures.ThreadPoolExecutor(threads) as pool:
                senders = set(pool.map(first_send, range(threads)))
            producer.close()
            assert len(senders) == 1, f"{len(senders)} senders"
    finally:
        sys.setswitchinterval(old_interval)


def test_backoff_doubles_up_to_a_cap() -> None:
    delays = [rows.retry_delay_s(n) for n in range(1, 12)]
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert delays[-1] == rows.RETRY_MAX_S and rows.retry_delay_s(10_000) == rows.RETRY_MAX_S


def test_many_threads_commit_concurrently_on_postgresql(pg_url, broker) -> None:
    with fresh_database(pg_url) as url:
        upgrade(url)
        engine = create_engine(url)
        orders.create(engine)
        producer = qmq.Producer(brokers=[broker.address], engine=engine)

        @qmq.transactional(producer)
        def place_order(session: Session, order_id: int) -> str:
            session.execute(orders.insert().values(id=order_id, item="book"))
            return producer.send("order.created", {"id": order_id})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda i: place_order(order_id=i), range(200)))
        assert producer.flush(20)
        producer.close()
        assert states(engine) == dict.fromkeys(ids, "sent")
        delivered = consume(broker.address, "order.created", 200)
        assert sorted(d.id for d in delivered) == sorted(ids)
        engine.dispose()


def test_delayed_messages_arrive_when_due_never_before(engine, broker, processes, tmp_path) -> None:
    delay = start_delay_server(processes, tmp_path / "delay", "--broker", broker.address)
    producer = qmq.Producer(brokers=[broker.address], delay_servers=[delay.address], engine=engine)

    @qmq.transactional(producer)
    def place_order(session: Session, order_id: int, fail: bool = False) -> tuple[str, datetime]:
        due = datetime.now(UTC) + timedelta(seconds=1.5)
        message_id = producer.send("payment.timeout", {"order": order_id}, deliver_at=due)
        if fail:
            raise RuntimeError("rolled back: its payment timeout must never fire")
        return message_id, due

    timeout_id, due = place_order(order_id=1)
    with pytest.raises(RuntimeError):
        place_order(order_id=2, fail=True)
    assert producer.flush(10)
    producer.close()
    assert states(engine) == {timeout_id: "sent"}  # accepted by the delay server
    [delivery] = consume(broker.address, "payment.timeout", 1)
    assert delivery.id == timeout_id and delivery.body == {"order": 1}
    assert delivery.stored_at >= due.replace(microsecond=due.microsecond // 1000 * 1000)


# ---- issue 15: natural code joins the caller's transaction or is refused; never a rolled-back message -------


class Oops(Exception):
    """The application changing its mind: its transaction rolls back."""


def attempt(fn) -> BaseException | None:
    """Run `fn`; the exception it raised, if any (asserted on after the deliveries were checked)."""
    try:
        fn()
    except Exception as exc:
        return exc
    return None


@pytest.fixture
def pg_engine(pg_url):
    with fresh_database(pg_url) as url:
        upgrade(url)
        engine = create_engine(url)
        orders.create(engine)
        yield engine
        engine.dispose()


@pytest.fixture
def pg_producer(pg_engine, broker):
    producer = qmq.Producer(brokers=[broker.address], engine=pg_engine)
    yield producer
    producer.close()


def delivered_ids(broker, subject: str, expected: int) -> list[str]:
    return sorted(d.id for d in consume(broker.address, subject, expected))


def test_a_send_that_is_not_told_its_transaction_is_refused_and_delivers_nothing(
    pg_producer, pg_engine, broker
) -> None:
    """Issue 15, case 1: `send` inside a Session or Connection transaction it was not given."""

    def in_a_session() -> None:
        with Session(pg_engine) as s, s.begin():
            s.execute(orders.insert().values(id=1, item="book"))
            pg_producer.send("order.created", {"id": 1})
            raise Oops

    def in_a_connection() -> None:
        with pg_engine.begin() as conn:
            conn.execute(orders.insert().values(id=2, item="book"))
            pg_producer.send("order.created", {"id": 2})
            raise Oops

    errors = [attempt(in_a_session), attempt(in_a_connection)]
    kept = pg_producer.send_now("order.created", {"id": "kept"})  # something that must arrive, to wait for
    assert pg_producer.flush(10)
    assert delivered_ids(broker, "order.created", 1) == [kept]
    assert order_count(pg_engine) == 0
    for error in errors:
        assert isinstance(error, qmq.NotInTransaction)
        assert "session=" in str(error) and "connection=" in str(error) and "send_now" in str(error)
        assert "open on this thread" in str(error)


def test_a_transaction_given_to_send_commits_or_rolls_back_with_it(pg_producer, pg_engine, broker) -> None:
    """Issue 15, case 1 fixed: `send(session=s)` and `send(connection=conn)`."""

    def session_rolls_back() -> None:
        with Session(pg_engine) as s, s.begin():
            s.execute(orders.insert().values(id=1, item="book"))
            pg_producer.send("order.created", {"id": 1}, session=s)
            raise Oops

    def connection_rolls_back() -> None:
        with pg_engine.begin() as conn:
            conn.execute(orders.insert().values(id=2, item="book"))
            pg_producer.send("order.created", {"id": 2}, connection=conn)
            raise Oops

    assert isinstance(attempt(session_rolls_back), Oops)
    assert isinstance(attempt(connection_rolls_back), Oops)
    with Session(pg_engine) as s, s.begin():
        s.execute(orders.insert().values(id=3, item="book"))
        in_session = pg_producer.send("order.created", {"id": 3}, session=s)
    with pg_engine.connect() as conn:  # commit as you go: joined, handed to the sender after the commit
        conn.execute(orders.insert().values(id=4, item="book"))
        in_connection = pg_producer.send("order.created", {"id": 4}, connection=conn)
        assert committed_ids(pg_engine) == {in_session}
        conn.commit()
    assert pg_producer.flush(10)
    assert delivered_ids(broker, "order.created", 2) == sorted([in_session, in_connection])
    assert states(pg_engine) == {in_session: "sent", in_connection: "sent"}  # by the sender, not left for a relay
    assert order_count(pg_engine) == 2


def test_a_database_that_went_away_fails_the_transaction_with_its_own_error(pg_producer, pg_engine, broker) -> None:
    """The application sees the OperationalError of the lost connection, as without qmq, and the next
    transaction works once the database is back. (The connection's rollback event asked the
    invalidated connection for its `info`: SQLAlchemy raised PendingRollbackError inside the
    application's rollback instead.)"""
    url = pg_engine.url.render_as_string(hide_password=False).replace("+psycopg", "")

    def cut_off() -> None:
        with pg_engine.begin() as conn:
            conn.execute(orders.insert().values(id=1, item="book"))
            pg_producer.send("order.created", {"id": 1}, connection=conn)
            set_connections_allowed(url, False)
            conn.execute(orders.insert().values(id=2, item="book"))

    try:
        error = attempt(cut_off)
    finally:
        set_connections_allowed(url, True)
    assert isinstance(error, sa.exc.OperationalError), repr(error)
    assert error.connection_invalidated
    with pg_engine.begin() as conn:
        conn.execute(orders.insert().values(id=3, item="book"))
        kept = pg_producer.send("order.created", {"id": 3}, connection=conn)
    assert pg_producer.flush(10)
    assert delivered_ids(broker, "order.created", 1) == [kept]
    assert order_count(pg_engine) == 1


def test_a_decorated_function_joins_the_transaction_its_caller_has_open(pg_producer, pg_engine, broker) -> None:
    """Issue 15, case 3: `@qmq.transactional` called inside `with SessionLocal() as s, s.begin():`
    (or `with engine.begin() as conn:`) joins it, instead of committing its row and message alone."""
    session_local = sessionmaker(pg_engine)

    @qmq.transactional(pg_producer)
    def place(session: Session, item: str) -> str:
        session.execute(orders.insert().values(id=len(item), item=item))
        return pg_producer.send("order.created", {"item": item})

    def session_rolls_back() -> None:
        with session_local() as s, s.begin():
            s.execute(sa.text("SELECT 1"))
            place(item="a")
            raise Oops

    def connection_rolls_back() -> None:
        with pg_engine.begin():
            place(item="bb")
            raise Oops

    assert isinstance(attempt(session_rolls_back), Oops)
    assert isinstance(attempt(connection_rolls_back), Oops)
    with session_local() as s, s.begin():
        in_session = place(item="ccc")
        assert committed_ids(pg_engine) == set()  # part of the caller's transaction: not committed yet
    with pg_engine.begin() as conn:
        conn.execute(orders.insert().values(id=10, item="caller's own row"))
        in_connection = [place(item="dddd"), place(item="ffffff")]
        assert committed_ids(pg_engine) == {in_session}
    alone = place(item="eeeee")  # no transaction open: its own, committed when it returns
    assert pg_producer.flush(10)
    assert delivered_ids(broker, "order.created", 4) == sorted([in_session, *in_connection, alone])
    assert order_count(pg_engine) == 5


def test_bodies_encode_dates_decimals_and_uuids_and_take_an_encoder(engine, broker) -> None:
    class Money:
        def __init__(self, cents: int) -> None:
            self.cents = cents

    def encode_money(value: object) -> object:  # as json.dumps's default=: TypeError for what it does not know
        if isinstance(value, Money):
            return {"cents": value.cents}
        raise TypeError(f"{type(value).__name__} is not Money")

    producer = qmq.Producer(brokers=[broker.address], engine=engine, encoder=encode_money)
    when = datetime(2026, 5, 1, 12, 30, tzinfo=UTC)
    token = uuid.UUID("12345678-1234-5678-1234-567812345678")
    body = {"at": when, "day": when.date(), "price": Decimal("19.90"), "id": token, "fee": Money(250)}
    message_id = producer.send_now("order.priced", body)
    with pytest.raises(TypeError, match="encoder="):
        producer.send_now("order.priced", {"bad": object()})
    assert producer.flush(10)
    producer.close()
    [delivery] = consume(broker.address, "order.priced", 1)
    assert delivery.id == message_id and delivery.content_type == "application/json"
    assert delivery.body == {
        "at": "2026-05-01T12:30:00+00:00",
        "day": "2026-05-01",
        "price": "19.90",
        "id": str(token),
        "fee": {"cents": 250},
    }


def test_the_senders_session_settings_do_not_leak_into_the_applications_pool(pg_producer, pg_engine, broker) -> None:
    """The sender ships on a connection of the application's engine with settings of its own (the
    lease as an idle-in-transaction timeout, commits that do not wait for the WAL flush), set for its
    transactions only; back in the pool after `close()`, that connection has the server's defaults."""
    pg_producer.send_now("order.created", "one")
    assert pg_producer.flush(10)
    pg_producer.close()
    engine_pool = pg_engine.pool
    seen = []
    connections = [pg_engine.connect() for _ in range(engine_pool.checkedin() + 1)]  # every pooled one
    try:
        for conn in connections:
            seen.append(
                conn.exec_driver_sql("SHOW synchronous_commit").scalar()
                + "/"
                + conn.exec_driver_sql("SHOW idle_in_transaction_session_timeout").scalar()
                + "/"
                + conn.exec_driver_sql("SHOW plan_cache_mode").scalar()
            )
    finally:
        for conn in connections:
            conn.close()
    assert set(seen) == {"on/0/auto"}
    assert delivered_ids(broker, "order.created", 1)
