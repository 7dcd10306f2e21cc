"""The shop's unit tests: its billing consumer runs in-process on commit (`qmq.testing.eager`), with
the same transaction rules as in production, and no qmq server anywhere."""

from __future__ import annotations

from decimal import Decimal

import pytest
import shop
import sqlalchemy as sa
from sqlalchemy.orm import Session

import qmq
import qmq.testing


def invoiced(engine) -> list[tuple[int, Decimal]]:
    with engine.connect() as conn:
        return [tuple(r) for r in conn.execute(sa.select(shop.invoices.c.order_id, shop.invoices.c.amount))]


def test_a_placed_order_is_invoiced_once(db) -> None:
    with qmq.testing.eager(shop.producer, shop.billing) as run:
        message_id = shop.place_order(order_id=7, item="book", price=Decimal("12.50"), quantity=2)
    assert [m.id for m in run.handled("order.created")] == [message_id]
    assert run.handled()[0].body == {"id": 7, "item": "book", "amount": "25.00"}
    assert invoiced(db) == [(7, Decimal("25.00"))]


def test_an_order_that_rolls_back_is_never_invoiced(db) -> None:
    with qmq.testing.eager(shop.producer, shop.billing) as run, pytest.raises(shop.OutOfStock):
        shop.place_order(order_id=8, item="book", price=Decimal("1"), quantity=99)
    assert run.handled() == [] and invoiced(db) == []


def test_a_send_outside_any_transaction_is_refused(db) -> None:
    with qmq.testing.eager(shop.producer, shop.billing) as run:
        with pytest.raises(qmq.NotInTransaction, match="send_now"):
            shop.producer.send("order.created", {"id": 9, "item": "book", "amount": "1"})
        shop.producer.send_now("order.created", {"id": 10, "item": "pen", "amount": "2"})
    assert [m.body["id"] for m in run.handled()] == [10]


def test_a_rejected_message_fails_the_test_unless_asked_not_to(db) -> None:
    with (
        pytest.raises(qmq.testing.HandlerFailed, match="invoiced by the partner"),
        qmq.testing.eager(shop.producer, shop.billing),
    ):
        shop.place_order(order_id=11, item="gift card", price=Decimal("50"))
    with qmq.testing.eager(shop.producer, shop.billing, propagate=False) as run:
        shop.place_order(order_id=12, item="gift card", price=Decimal("50"))
    assert [d.message.body["id"] for d in run.dead] == [12] and invoiced(db) == []


def test_orders_placed_inside_the_callers_transaction_are_invoiced_after_its_commit(db) -> None:
    with qmq.testing.eager(shop.producer, shop.billing) as run, Session(shop.engine) as session, session.begin():
        shop.place_order(order_id=13, item="book", price=Decimal("3"))
        shop.place_order(order_id=14, item="pen", price=Decimal("4"))
        assert run.handled() == []  # not committed yet
    assert sorted(order for order, _ in invoiced(db)) == [13, 14]
