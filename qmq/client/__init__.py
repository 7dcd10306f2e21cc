"""The qmq client: send messages to broker groups and consume them, blocking or with asyncio.

    from qmq.client import Client, OutgoingMessage
    client = Client(meta="127.0.0.1:20880")
    client.send_one("order.created", {"id": 7}, key="7", tags=["new"])

Modules: `core` (the decisions, no I/O), `routes` (routes and their cache), `pool` (connections by
address), `blocking` (`Client`), `aio` (`AsyncClient`).
"""

from qmq.client.aio import AsyncClient, AsyncSubscription
from qmq.client.blocking import Client, Subscription
from qmq.client.core import (
    ClientError,
    Delivery,
    InvalidMessage,
    MetaUnreachable,
    NoRoute,
    OutgoingMessage,
    SendError,
    SendResult,
)

__all__ = [
    "AsyncClient",
    "AsyncSubscription",
    "Client",
    "ClientError",
    "Delivery",
    "InvalidMessage",
    "MetaUnreachable",
    "NoRoute",
    "OutgoingMessage",
    "SendError",
    "SendResult",
    "Subscription",
]
