"""Checking a per-application credential presented in a handshake (docs/security.md).

An `Authenticator` turns a token into the `Principal` it stands for, or None when it stands for
nothing (unknown, revoked, a wrong secret). The meta server checks against its database
(`qmq.meta.credentials.LocalAuthenticator`); brokers and delay servers ask the meta server
(`MetaAuthenticator`, META_CREDENTIAL_CHECK with the shared token) and keep each answer for
CHECK_CACHE_S, so a revoked credential is refused within that time, on new connections and on
connections already open (the server re-checks an open connection's credential that often).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Protocol

from qmq.net.acl import Principal
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, RemoteError

CHECK_CACHE_S = 10.0  # how long a broker trusts the meta server's answer about a credential
REFUSAL_CACHE_S = 1.0  # how long it remembers a refusal (a client retrying a bad token costs little)
CHECK_TIMEOUT_S = 5.0
MAX_CACHED = 10_000


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> Principal | None:
        """The principal `token` stands for, or None; raises (OSError, TimeoutError, RemoteError)
        when it cannot tell now."""
        ...


class MetaAuthenticator:
    """Asks the meta server (any of a comma-separated list) and caches its answers."""

    def __init__(self, meta: str, token: str | None) -> None:
        self.addresses = [a.strip() for a in meta.split(",") if a.strip()]
        self.token = token
        self._cache: dict[bytes, tuple[float, Principal | None]] = {}  # sha256(token) -> (until, answer)
        self._conn = None
        self._lock = asyncio.Lock()
        self._next = 0

    async def authenticate(self, token: str) -> Principal | None:
        key = hashlib.sha256(token.encode()).digest()  # no token kept in clear
        now = time.monotonic()
        cached = self._cache.get(key)
        if cached is not None and cached[0] > now:
            return cached[1]
        principal = await self._ask(token)
        if len(self._cache) >= MAX_CACHED:
            self._cache = {k: v for k, v in self._cache.items() if v[0] > now}
        self._cache[key] = (now + (CHECK_CACHE_S if principal else REFUSAL_CACHE_S), principal)
        return principal

    async def _ask(self, token: str) -> Principal | None:
        from qmq.net.aio_client import AsyncConnection  # (the client side imports nothing of this)

        async with self._lock:
            last_error: BaseException | None = None
            for _ in range(len(self.addresses)):
                try:
                    if self._conn is None or self._conn.closed:
                        host, _, port = self.addresses[self._next].rpartition(":")
                        self._conn = await AsyncConnection.open(
                            host, int(port), token=self.token or "", client_id="credential-check"
                        )
                    reply = await self._conn.request(
                        RequestCode.META_CREDENTIAL_CHECK, {"token": token}, timeout=CHECK_TIMEOUT_S
                    )
                    return Principal.from_wire(reply)
                except RemoteError as exc:
                    if exc.code == ErrorCode.UNAUTHORIZED:
                        return None
                    last_error = exc
                except (OSError, TimeoutError) as exc:
                    last_error = exc
                if self._conn is not None:
                    await self._conn.close()
                    self._conn = None
                self._next = (self._next + 1) % len(self.addresses)
            raise ConnectionError(f"cannot ask the meta server about a credential: {last_error}")
