"""A sample shop, as a qmq user writes one: orders placed in a transaction that sends
`order.created`, and a billing consumer that invoices each order once. Its own unit tests
(test_shop.py) run the consumer in-process with `qmq.testing.eager`, without any qmq server.

In production: `qmq db upgrade --db $SHOP_DB_URL`, `qmq dev --db $SHOP_DB_URL` (or real servers) and
`qmq worker -A shop:billing`.
"""

from __future__ import annotations

import os
from decimal import Decimal

import sqlalchemy as sa
from sqlalchemy.orm import Session

import qmq
from qmq.db.engine import create_engine

metadata = sa.MetaData()
orders = sa.Table(
    "orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("item", sa.String(50), nullable=False),
    sa.Column("amount", sa.Numeric(10, 2), nullable=False),
)
invoices = sa.Table(
    "invoices",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("order_id", sa.Integer, nullable=False),
    sa.Column("amount", sa.Numeric(10, 2), nullable=False),
)

engine = create_engine(os.environ.get("SHOP_DB_URL", "sqlite:///shop.sqlite3"))
producer = qmq.Producer(meta=os.environ.get("QMQ_META", "127.0.0.1:20880"), engine=engine)
billing = qmq.App("billing", meta=os.environ.get("QMQ_META", "127.0.0.1:20880"), engine=engine)

MAX_QUANTITY = 10


class OutOfStock(Exception):
    pass


@qmq.transactional(producer)
def place_order(session: Session, order_id: int, item: str, price: Decimal, quantity: int = 1) -> str:
    """Record the order and announce it; all or nothing."""
    session.execute(orders.insert().values(id=order_id, item=item, amount=price * quantity))
    message_id = producer.send("order.created", {"id": order_id, "item": item, "amount": price * quantity})
    if quantity > MAX_QUANTITY:
        raise OutOfStock(item)
    return message_id


@billing.consumer("order.created", idempotent=True)
def invoice(message: qmq.Message, session: Session) -> None:
    order = message.body
    if order["item"] == "gift card":
        raise qmq.Reject("gift cards are invoiced by the partner")
    session.execute(invoices.insert().values(order_id=order["id"], amount=Decimal(order["amount"])))
