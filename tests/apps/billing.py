"""The app of the "why was this order not billed?" scenario (tests/test_admin_scenario.py,
tests/test_console.py): `order.created` is consumed by group `billing`, which bills an order only
when its customer has a billing account. An order of a customer without one fails every attempt and
is dead-lettered after 32 (max_retries=31; a short backoff keeps the test quick); once the account
exists, a re-driven message bills it. `order.shipped` is consumed by group `shipping`, slowly, so a
backlog visibly goes down.

Settings (environment): QMQ_META (the worker's), QMQ_TOKEN, QMQ_TEST_DB (the app's PostgreSQL
database, with qmq's tables and those of billing_schema.py).
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

import qmq
from tests.apps.billing_schema import ATTEMPTS, SHIP_S

app = qmq.App("billing", db=os.environ.get("QMQ_TEST_DB"))


@app.consumer(
    "order.created",
    group="billing",
    start="earliest",
    idempotent=True,
    max_retries=ATTEMPTS - 1,
    retry_backoff=0.01,
    retry_backoff_max=0.02,
    retry_jitter=False,
)
def bill(message: qmq.Message, session) -> None:
    order = message.body
    account = session.execute(
        sa.text("SELECT account FROM billing_accounts WHERE customer = :c"), {"c": order["customer"]}
    ).scalar()
    if account is None:
        raise LookupError(f"no billing account for customer {order['customer']}")
    session.execute(
        sa.text("INSERT INTO invoices (order_id, account, billed_at) VALUES (:o, :a, now())"),
        {"o": order["order"], "a": account},
    )


@app.consumer("order.shipped", group="shipping", start="earliest")
def ship(message: qmq.Message) -> None:
    time.sleep(SHIP_S)  # slow enough that a backlog visibly goes down
