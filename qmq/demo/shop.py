"""The demo's shop: orders placed with `@qmq.transactional` in plain SQLAlchemy. Each order sends
`order.created` and a delayed `payment.timeout` in its own transaction; declined payments roll back
(no order, no message); gift orders also send `order.gift`, whose handler always fails."""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

import qmq

PAYMENT_TIMEOUT_S = 3.0  # a real shop: 30 minutes

metadata = sa.MetaData()
orders = sa.Table(
    "demo_orders",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True),
    sa.Column("item", sa.String(50), nullable=False),
    sa.Column("paid", sa.Boolean, nullable=False, server_default=sa.false()),
)
invoices = sa.Table("demo_invoices", metadata, sa.Column("order_id", sa.Integer, primary_key=True))
emails = sa.Table(
    "demo_emails",
    metadata,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("attempts", sa.Integer, nullable=False),
)
timeouts = sa.Table(
    "demo_payment_timeouts",
    metadata,
    sa.Column("order_id", sa.Integer, primary_key=True),
    sa.Column("cancelled", sa.Boolean, nullable=False),
)


class PaymentDeclined(Exception):
    """The customer's card said no: the order and its messages roll back."""


def order_placer(producer: qmq.Producer):
    """`place_order(order_id, item, pay, decline, gift) -> message ids`, one transaction each."""

    @qmq.transactional(producer)
    def place_order(
        session: Session, order_id: int, item: str, *, pay: bool = False, decline: bool = False, gift: bool = False
    ) -> list[str]:
        session.execute(orders.insert().values(id=order_id, item=item, paid=pay))
        ids = [
            producer.send("order.created", {"id": order_id, "item": item}, key=str(order_id)),
            producer.send("payment.timeout", {"id": order_id}, key=str(order_id), delay=PAYMENT_TIMEOUT_S),
        ]
        if gift:
            ids.append(producer.send("order.gift", {"id": order_id}, key=str(order_id)))
        if decline:
            raise PaymentDeclined(f"order {order_id}")
        return ids

    return place_order
