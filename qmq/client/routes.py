"""Routes: which broker groups carry a subject, and how long a client may trust what it was told.

A route comes from the meta server (`META_ROUTE`, docs/meta.md) or, without a meta server, from a
static list of broker addresses where each address is a group of its own (the embedded cluster and
tests). Producers send only to groups that are available and not read-only; consumers pull from
every group of the route, so that they drain groups that stopped taking new messages.

Nothing here does I/O: the blocking and the asyncio client fetch routes over their own connections
and keep them in a `RouteCache`, which says when a route is too old to use without asking again.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

ROUTE_TTL_S = 30.0  # a route is asked for again after this long
EMPTY_ROUTE_TTL_S = 1.0  # a route with no writable group is asked for again sooner: a broker may join
META_RETRY_S = 5.0  # while the meta server is unreachable, a stale route is used this long before asking again
META_TIMEOUT_S = 10.0  # wait for a META_ROUTE reply
DEFAULT_META_ADDRESS = "127.0.0.1:20880"


def parse_address(address: str) -> tuple[str, int]:
    """`"host:port"` -> `("host", port)`; raises ValueError naming the bad address."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r} is not an address of the form host:port")
    return host.strip("[]"), int(port)


@dataclass(frozen=True)
class RouteGroup:
    """One broker group of a route, with its flags as the meta server last reported them."""

    name: str
    addresses: tuple[str, ...]
    available: bool = True
    read_only: bool = False

    @property
    def writable(self) -> bool:
        return self.available and not self.read_only and bool(self.addresses)


@dataclass(frozen=True)
class Route:
    subject: str
    groups: tuple[RouteGroup, ...]
    # Delay servers, each a group of its own named by its address (delayed messages go there).
    delay_servers: tuple[RouteGroup, ...] = ()

    @functools.cached_property
    def writable_groups(self) -> tuple[RouteGroup, ...]:
        return tuple(g for g in self.groups if g.writable)

    @functools.cached_property
    def delay_route(self) -> Route:
        """The route of the subject's delayed messages: its groups are the delay servers."""
        return Route(self.subject, self.delay_servers)

    def group(self, name: str) -> RouteGroup | None:
        return next((g for g in self.groups if g.name == name), None)


def route_request(subject: str) -> dict[str, Any]:
    """The META_ROUTE body. Consumers ask with `create` too, so that a consumer that subscribes
    before the first message is sent already pulls from the groups the producer will send to."""
    return {"subject": subject, "create": True}


def parse_route(subject: str, reply: dict[str, Any]) -> Route:
    """A META_ROUTE reply as a `Route`; groups keep the order the meta server gave them."""
    groups = []
    for item in reply.get("groups") or ():
        groups.append(
            RouteGroup(
                name=str(item["name"]),
                addresses=tuple(str(a) for a in item.get("addresses") or ()),
                available=bool(item.get("available", True)),
                read_only=bool(item.get("read_only", False)),
            )
        )
    delay_servers = tuple(
        RouteGroup(str(item["address"]), (str(item["address"]),), bool(item.get("available", True)))
        for item in reply.get("delay_servers") or ()
    )
    return Route(subject, tuple(groups), delay_servers)


def static_route(subject: str, brokers: Sequence[str], delay_servers: Sequence[str] = ()) -> Route:
    """The route when broker (and delay server) addresses are given directly: every address is a
    group of its own, named by its address, and always assumed writable (a failed send tries the
    next one)."""
    return Route(
        subject,
        tuple(RouteGroup(address, (address,)) for address in brokers),
        tuple(RouteGroup(address, (address,)) for address in delay_servers),
    )


def with_delay_servers(route: Route, delay_servers: Sequence[str]) -> Route:
    """`route` with these delay servers instead of the meta server's (given to the client directly)."""
    if not delay_servers:
        return route
    return Route(route.subject, route.groups, tuple(RouteGroup(a, (a,)) for a in delay_servers))


def listed_delay_servers(reply: dict[str, Any]) -> list[str]:
    """The available delay servers in a META_LIST reply."""
    return [
        str(s["address"]) for s in reply.get("servers") or () if s.get("kind") == "delay" and s.get("available", True)
    ]


class RouteCache:
    """Routes by subject with the time until which each may be used without asking again.
    Thread-safe; the asyncio client uses it from one thread only, where the lock is never contended."""

    def __init__(self, ttl_s: float = ROUTE_TTL_S, empty_ttl_s: float = EMPTY_ROUTE_TTL_S) -> None:
        self.ttl_s = ttl_s
        self.empty_ttl_s = empty_ttl_s
        self._lock = threading.Lock()
        self._routes: dict[str, tuple[Route, float]] = {}  # subject -> (route, use until)

    def fresh(self, subject: str, now: float) -> Route | None:
        """The cached route if it may still be used without asking again."""
        with self._lock:
            entry = self._routes.get(subject)
        return entry[0] if entry is not None and now < entry[1] else None

    def stale(self, subject: str) -> Route | None:
        """The cached route however old: better than nothing while the meta server is unreachable."""
        with self._lock:
            entry = self._routes.get(subject)
        return entry[0] if entry else None

    def put(self, route: Route, now: float, ttl_s: float | None = None) -> None:
        """Cache `route` for `ttl_s` (default: ROUTE_TTL_S, or EMPTY_ROUTE_TTL_S when it has no
        writable group, since a broker may register any moment)."""
        if ttl_s is None:
            ttl_s = self.ttl_s if route.writable_groups else self.empty_ttl_s
        with self._lock:
            self._routes[route.subject] = (route, now + ttl_s)

    def invalidate(self, subjects: Iterable[str]) -> None:
        """Make these routes stale (a send to one of their groups failed), so the next use asks
        again; they stay available as fallbacks."""
        with self._lock:
            for subject in subjects:
                entry = self._routes.get(subject)
                if entry is not None:
                    self._routes[subject] = (entry[0], float("-inf"))
