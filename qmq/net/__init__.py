"""Network layer on the qmq wire protocol: an asyncio server helper (`serve`), an asyncio client
(`AsyncConnection`) and a thread-safe blocking client (`BlockingConnection`) for WSGI apps."""

from qmq.net.aio_client import AsyncConnection
from qmq.net.client import BlockingConnection
from qmq.net.server import PeerInfo, Server, serve

__all__ = ["AsyncConnection", "BlockingConnection", "PeerInfo", "Server", "serve"]
