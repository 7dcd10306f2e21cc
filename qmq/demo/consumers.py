"""The demo's worker app (`qmq worker -A qmq.demo.consumers:app`): billing, payment timeouts, a
confirmation e-mail that fails twice for some orders before it works, and a gift service that always
fails and ends dead-lettered. Every handler is idempotent (SQL), so repeated deliveries change nothing.
The meta server and the database come from $QMQ_META and $QMQ_DB_URL."""

from __future__ import annotations

import os

import sqlalchemy as sa

import qmq
from qmq.demo.shop import emails, invoices, orders, timeouts

FLAKY_EVERY = 10  # orders whose id ends in 3 get an e-mail that fails twice first
EMAIL_FAILURES = 2

app = qmq.App("shop", meta=os.environ.get("QMQ_META"), db=os.environ.get("QMQ_DB_URL"))


@app.consumer("order.created", group="billing", idempotent=True, start="earliest")
def bill(message: qmq.Message, session) -> None:
    session.execute(invoices.insert().values(order_id=message.body["id"]))


@app.consumer(
    "order.created",
    group="email",
    idempotent=True,
    start="earliest",
    retry_backoff=0.5,
    retry_jitter=False,
    max_retries=5,
)
def confirm(message: qmq.Message, session) -> None:
    order_id = message.body["id"]
    if order_id % FLAKY_EVERY == 3 and message.attempts <= EMAIL_FAILURES:
        raise ConnectionError(f"mail server busy (attempt {message.attempts})")
    session.execute(emails.insert().values(order_id=order_id, attempts=message.attempts))


@app.consumer("payment.timeout", group="payments", idempotent=True, start="earliest")
def payment_timeout(message: qmq.Message, session) -> None:
    order_id = message.body["id"]
    paid = session.execute(sa.select(orders.c.paid).where(orders.c.id == order_id)).scalar_one()
    session.execute(timeouts.insert().values(order_id=order_id, cancelled=not paid))  # unpaid: cancelled


@app.consumer(
    "order.gift", group="gifts", idempotent=True, start="earliest", retry_backoff=0.2, retry_jitter=False, max_retries=2
)
def wrap_gift(message: qmq.Message) -> None:
    raise RuntimeError("the gift-wrapping service is down")
