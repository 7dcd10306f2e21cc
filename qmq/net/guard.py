"""What a server allows its clients, so that no client (authenticated or not) can take its memory or
its connections from the others: how many connections in all and per peer address, how many bytes
one connection may hold (unanswered requests plus a frame being read), a memory budget shared by
every connection of the server, and how long a connection may stay idle or leave its replies unread.

`NetLimits` holds the numbers (the servers' `--max-connections`, ... options; docs/security.md);
`MemoryBudget` and `ConnectionCaps` are the server-wide counters `qmq.net.server.Server` keeps.
No I/O here beyond waiting on asyncio events.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass

MAX_CONNECTIONS = 10_000  # per server (listener)
MAX_CONNECTIONS_PER_ADDRESS = 1_000  # per peer IP address
MAX_CONNECTION_BYTES = 64 * 1024 * 1024  # unanswered requests and buffered input of one connection
MEMORY_BUDGET_BYTES = 512 * 1024 * 1024  # the same, summed over every connection of a server
MEMORY_WAIT_S = 30.0  # a connection waits this long for budget, then is refused (UNAVAILABLE)
IDLE_TIMEOUT_S = 900.0  # a connection with no request for this long (and none in flight) is closed
SLOW_READ_TIMEOUT_S = 30.0  # a peer whose unread replies stay above the write buffer limit this long is cut
WRITE_BUFFER_BYTES = 1024 * 1024  # replies queued for a peer above this make the handler wait for it


@dataclass(frozen=True)
class NetLimits:
    """Per-server limits on clients. None for a timeout disables it."""

    max_connections: int = MAX_CONNECTIONS
    max_connections_per_address: int = MAX_CONNECTIONS_PER_ADDRESS
    max_connection_bytes: int = MAX_CONNECTION_BYTES
    memory_budget_bytes: int = MEMORY_BUDGET_BYTES
    memory_wait_s: float = MEMORY_WAIT_S
    idle_timeout_s: float | None = IDLE_TIMEOUT_S
    slow_read_timeout_s: float | None = SLOW_READ_TIMEOUT_S
    write_buffer_bytes: int = WRITE_BUFFER_BYTES


DEFAULT_NET_LIMITS = NetLimits()


class MemoryBudget:
    """Bytes held by a server's connections, against a limit. A connection `charge`s what it reads
    and `release`s it when the request is answered; before reading it `wait`s while the server is
    over budget. The budget may be overshot by one read per connection: a read is never split, and
    a connection holding nothing is always let in eventually (when others release), never starved."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.used_bytes = 0
        self.peak_bytes = 0
        self._released = asyncio.Event()

    @property
    def exhausted(self) -> bool:
        return self.used_bytes >= self.limit_bytes

    def charge(self, nbytes: int) -> None:
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def release(self, nbytes: int) -> None:
        self.used_bytes -= nbytes
        if nbytes and not self.exhausted:
            self._released.set()

    async def wait(self, timeout_s: float) -> None:
        """Return when the server is under budget; TimeoutError after `timeout_s` of waiting."""
        async with asyncio.timeout(timeout_s):
            while self.exhausted:
                self._released.clear()
                await self._released.wait()


class ConnectionCaps:
    """Connections open on a server, in all and per peer address."""

    def __init__(self, limits: NetLimits) -> None:
        self.limits = limits
        self.total = 0
        self.per_address: Counter[str] = Counter()

    def admit(self, address: str) -> str | None:
        """Count a new connection from `address`, or say why it is refused (and count nothing)."""
        if self.total >= self.limits.max_connections:
            return f"the server has {self.total} connections, its limit (--max-connections)"
        if self.per_address[address] >= self.limits.max_connections_per_address:
            return (
                f"{address} has {self.per_address[address]} connections to this server, "
                "the limit per address (--max-connections-per-address)"
            )
        self.total += 1
        self.per_address[address] += 1
        return None

    def leave(self, address: str) -> None:
        self.total -= 1
        self.per_address[address] -= 1
        if self.per_address[address] <= 0:
            del self.per_address[address]
