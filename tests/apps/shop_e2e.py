"""The consumers of tests/test_end_to_end.py (`qmq worker -A tests.apps.shop_e2e:app`): billing and
reminders, idempotent in SQL (their tables: tests/apps/shop_e2e_tables.py)."""

from __future__ import annotations

import os

import qmq
from tests.apps.shop_e2e_tables import invoices, reminders

app = qmq.App("e2e", meta=os.environ.get("QMQ_META"), db=os.environ.get("QMQ_DB_URL"))


@app.consumer("order.created", group="billing", idempotent=True, start="earliest", retry_backoff=0.5)
def bill(message: qmq.Message, session) -> None:
    session.execute(invoices.insert().values(order_id=message.body["id"]))


@app.consumer("order.reminder", group="reminders", idempotent=True, start="earliest", retry_backoff=0.5)
def remind(message: qmq.Message, session) -> None:
    session.execute(reminders.insert().values(order_id=message.body["id"]))
