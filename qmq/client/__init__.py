"""The qmq client: send messages to broker groups and consume them, blocking or with asyncio.

    from qmq.client import Client, OutgoingMessage
    client = Client(meta="127.0.0.1:20880")
    client.send_one("order.created", {"id": 7}, key="7", tags=["new"])

The decisions live once, without I/O (h11 style), one concern a module: `core` (the client's
settings and operations, each a loop of `steps`), `routes` (which groups carry a subject),
`sending` (the send loop: group choice, batches, retries), `messages` (what is sent, checked as a
broker checks it), `deliveries` (what a subscription asks for and must acknowledge), `consuming`
(a subscription's loops), `errors`. Two drivers do the steps: `blocking` (`Client`, threads) and
`aio` (`AsyncClient`, asyncio), over `pool` (connections by address).
"""

from qmq.client.aio import AsyncClient, AsyncSubscription
from qmq.client.blocking import Client, Subscription
from qmq.client.deliveries import Delivery
from qmq.client.errors import (
    ClientClosed,
    ClientError,
    InvalidMessage,
    InvalidSubscription,
    MetaUnreachable,
    NoRoute,
)
from qmq.client.messages import OutgoingMessage, SendError, SendResult, check_message

__all__ = [
    "AsyncClient",
    "AsyncSubscription",
    "Client",
    "ClientClosed",
    "ClientError",
    "Delivery",
    "InvalidMessage",
    "InvalidSubscription",
    "MetaUnreachable",
    "NoRoute",
    "OutgoingMessage",
    "SendError",
    "SendResult",
    "Subscription",
    "check_message",
]
