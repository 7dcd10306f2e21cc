"""`qmq.Message`: what a handler receives. Plain data, so that it crosses into a pool process as is.

`body` is decoded by content type (a JSON value, text, or bytes); `attempts` is 1 on the first
delivery and grows with each retry; `created_at` is the producer's clock (None when the message
was not sent by a qmq client), `stored_at` the broker's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from qmq.client import Delivery
from qmq.protocol.ordering import ORDER_KEY_HEADER, base_subject


@dataclass(frozen=True, slots=True)
class Message:
    id: str
    subject: str
    group: str
    body: Any
    content_type: str
    tags: tuple[str, ...]
    key: str | None
    headers: dict[str, str]
    attempts: int
    created_at: datetime | None
    stored_at: datetime | None

    @property
    def order_key(self) -> str | None:
        """The key this message is ordered by (`producer.send(..., order_key=)`), None if unordered."""
        return self.headers.get(ORDER_KEY_HEADER)

    @classmethod
    def from_delivery(cls, delivery: Delivery, group: str) -> Message:
        return cls(
            delivery.id,
            base_subject(delivery.subject),  # an ordered message's queue subject names its subject
            group,
            delivery.body,
            delivery.content_type,
            delivery.tags,
            delivery.key,
            delivery.headers,
            delivery.attempt,
            delivery.created_at,
            delivery.stored_at,
        )
