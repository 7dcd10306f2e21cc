"""The billing consumer: `qmq worker -A tests.apps.django_shop.consumers:app`. Its handler uses the
ORM; it runs with its idempotency record in one `transaction.atomic` block."""

from __future__ import annotations

import os

import django

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.apps.django_shop.settings")
django.setup()

import qmq  # noqa: E402
from tests.apps.django_shop.shop.models import Invoice  # noqa: E402

app = qmq.App("billing", using="default")  # where the brokers are: $QMQ_META


@app.consumer("order.created", idempotent=True)
def invoice(message: qmq.Message) -> None:
    Invoice.objects.create(order_id=message.body["id"])
