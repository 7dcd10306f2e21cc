"""The producer side: an order and its message commit together, or neither does."""

from __future__ import annotations

from django.db import transaction

import qmq
from tests.apps.django_shop.shop.models import Order

producer = qmq.Producer(using="default")  # where the brokers are: $QMQ_META


@qmq.transactional(producer)
def place_order(item: str) -> str:
    order = Order.objects.create(item=item)
    message_id = producer.send("order.created", {"id": order.id, "item": item})
    if item == "unavailable":
        raise LookupError(item)  # rolls back the order and its message
    return message_id


def place_order_in_a_view(item: str) -> str:
    """What a view under ATOMIC_REQUESTS (or any atomic block) does: send joins the block."""
    with transaction.atomic():
        order = Order.objects.create(item=item)
        return producer.send("order.created", {"id": order.id, "item": item})
