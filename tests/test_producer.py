"""The transactional producer with plain SQLAlchemy sessions, on PostgreSQL and SQLite, against a
real broker: what a transaction commits is delivered, what it rolls back never exists, and the app
never waits for or fails because of a broker."""

from __future__ import annotations

import concurrent.futures
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import qmq
from qmq.client.core import InvalidMessage
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.outbox import rows
from tests.support.broker import start_broker
from tests.support.databases import fresh_database, sqlite_or_postgres
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
def engine(db_url):
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def broker(processes, tmp_path):
    return start_broker(processes, tmp_path / "broker")


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


def test_outside_a_transaction_send_commits_its_row_alone(producer, engine, broker) -> None:
    message_id = producer.send("audit.event", "user logged in")
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
        producer.send("ok.subject", object())
    with pytest.raises(InvalidMessage, match="the limit is"):
        producer.send("ok.subject", b"x" * (5 * 1024 * 1024))
    with pytest.raises(ValueError, match="730 days"):
        send(subject="order.timeout", delay=800 * 86400)
    with pytest.raises(ValueError, match="timezone"):
        producer.send("order.timeout", "x", deliver_at=datetime(2030, 1, 1))
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
    message_id = producer.send("order.created", "for the relay")
    row = outbox_rows(engine)[message_id]
    assert (row.state, row.lease_token) == ("pending", None)  # no lease: any relay may ship it now
    producer.close()


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
