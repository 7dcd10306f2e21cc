"""The Flask-SQLAlchemy flavour: `@qmq.transactional(producer)` on views that use `db.session`, on
PostgreSQL and SQLite, through Flask's test client, with a real broker."""

from __future__ import annotations

import contextlib

import pytest
from flask import Flask, abort
from flask_sqlalchemy import SQLAlchemy
from sqlalchemy.orm import Mapped, mapped_column

import qmq
from qmq.db.engine import create_engine, fix_sqlite_transactions
from qmq.db.migrate import upgrade
from qmq.db.url import normalize_url
from tests.support.databases import fresh_database, sqlite_or_postgres
from tests.support.outbox import consume, states


@pytest.fixture(params=["postgresql", "sqlite"])
def db_url(request, tmp_path):
    with sqlite_or_postgres(request.param, request, tmp_path, "flask.sqlite3") as url:
        upgrade(url)
        yield url


@pytest.fixture
def shop(db_url, broker):
    """A Flask shop whose order view sends a message in its transaction."""
    app = Flask("shop")
    app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(db_url)
    db = SQLAlchemy(app)

    class Order(db.Model):
        id: Mapped[int] = mapped_column(primary_key=True)
        item: Mapped[str]

    producer = qmq.Producer(brokers=[broker.address], session=db.session)

    @qmq.transactional(producer)
    def reserve_stock(order_id: int) -> str:
        message_id = producer.send("stock.reserved", {"order": order_id})
        if order_id == 7:
            raise LookupError("out of stock")
        return message_id

    @app.post("/orders/<int:order_id>")
    @qmq.transactional(producer)
    def place_order(order_id: int):
        db.session.get(Order, 0)  # a query first: the session has auto-begun its transaction
        db.session.add(Order(id=order_id, item="book"))
        ids = [producer.send("order.created", {"id": order_id})]
        with contextlib.suppress(LookupError):
            ids.append(reserve_stock(order_id))  # joins with a savepoint
        if order_id == 13:
            abort(409)  # rolls back the order and its messages
        return {"message_ids": ids}

    with app.app_context():
        db.create_all()
        if db.engine.dialect.name == "sqlite":
            fix_sqlite_transactions(db.engine)  # as the guide says: savepoints on pysqlite
    yield app, producer, db, Order
    producer.close()


def test_views_commit_their_messages_with_their_rows(shop, db_url, broker) -> None:
    app, producer, db, order_model = shop
    client = app.test_client()
    ok = client.post("/orders/1").get_json()["message_ids"]
    partial = client.post("/orders/7").get_json()["message_ids"]  # the stock savepoint rolled back
    assert client.post("/orders/13").status_code == 409
    assert (len(ok), len(partial)) == (2, 1)

    assert producer.flush(10)
    engine = create_engine(db_url)
    assert states(engine) == dict.fromkeys(ok + partial, "sent")
    engine.dispose()
    with app.app_context():
        assert sorted(o.id for o in db.session.scalars(db.select(order_model))) == [1, 7]
    assert sorted(d.body["id"] for d in consume(broker.address, "order.created", 2)) == [1, 7]
    assert [d.body["order"] for d in consume(broker.address, "stock.reserved", 1)] == [1]


def test_db_session_is_joined_without_the_decorator_from_the_first_request(pg_url, broker) -> None:
    """Issue 15, case 2: `Producer(session=db.session)` and `db.session.add(o); producer.send(...);
    db.session.rollback()` delivers nothing, in a fresh process as after a decorated request, and
    `db.session.commit()` delivers once."""
    with fresh_database(pg_url) as url:
        upgrade(url)
        app = Flask("fresh_shop")
        app.config["SQLALCHEMY_DATABASE_URI"] = normalize_url(url)
        db = SQLAlchemy(app)

        class Order(db.Model):
            id: Mapped[int] = mapped_column(primary_key=True)

        producer = qmq.Producer(brokers=[broker.address], session=db.session)  # no engine: learnt from db.session

        @qmq.transactional(producer)
        def decorated(order_id: int) -> str:
            db.session.add(Order(id=order_id))
            return producer.send("order.created", {"id": order_id})

        def undecorated(order_id: int, commit: bool) -> str:
            db.session.add(Order(id=order_id))
            message_id = producer.send("order.created", {"id": order_id})
            db.session.commit() if commit else db.session.rollback()
            return message_id

        with app.app_context():
            db.create_all()
            rolled_back = [undecorated(1, commit=False)]  # first thing this producer ever does
        with app.app_context():
            committed = [decorated(2)]
        with app.app_context():
            rolled_back.append(undecorated(3, commit=False))
            committed.append(undecorated(4, commit=True))
            assert sorted(o.id for o in db.session.scalars(db.select(Order))) == [2, 4]
            db.session.remove()
            db.engine.dispose()
        assert producer.flush(10)
        producer.close()
        delivered = consume(broker.address, "order.created", 2)
        assert sorted(d.id for d in delivered) == sorted(committed)
        assert not set(rolled_back) & {d.id for d in delivered}
