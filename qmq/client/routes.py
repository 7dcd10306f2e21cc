"""Routes: which broker groups carry a subject, and how long a client may trust what it was told.

A route comes from the meta server (`META_ROUTE`, docs/meta.md; several may be listed, `A,B,C`, and
are asked in turn) or, without a meta server, from a
static list of broker addresses where each address is a group of its own (the embedded cluster and
tests). Producers send only to groups that are available and not read-only; consumers pull from
every group of the route, so that they drain groups that stopped taking new messages.

Nothing here does I/O. A `RouteBook` is where a client gets its routes: its look-up is a loop of
steps (`qmq.client.steps`) that asks the meta server only when the `RouteCache` says a route is too
old, and falls back on the route fetched before while the meta server cannot answer.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from qmq.client.errors import ClientClosed, ClientError, ConnectFailed, MetaUnreachable, NoRoute
from qmq.client.steps import Call, Steps
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteError
from qmq.protocol.ordering import split_queue_subject

log = logging.getLogger("qmq.client")

ROUTE_TTL_S = 30.0  # a route is asked for again after this long
EMPTY_ROUTE_TTL_S = 1.0  # a route with no writable group is asked for again sooner: a broker may join
META_RETRY_S = 5.0  # while the meta server is unreachable, a stale route is used this long before asking again
META_TIMEOUT_S = 10.0  # wait for a META_ROUTE or META_LIST reply
META_NEXT_AFTER_S = 2.0  # with another meta server left to ask, wait at most this long for one
DEFAULT_META_ADDRESS = "127.0.0.1:20880"
META_ENV = "QMQ_META"


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
    # A replicated group's epoch as the meta server last named it (0: not replicated, or unknown).
    epoch: int = 0

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
                epoch=int(item.get("epoch") or 0),
            )
        )
    delay_servers = tuple(
        RouteGroup(
            str(item["address"]),
            (str(item["address"]),),
            bool(item.get("available", True)),
            epoch=int(item.get("epoch") or 0),
        )
        for item in reply.get("delay_servers") or ()
    )
    return Route(subject, tuple(groups), delay_servers)


def with_epoch(body: dict[str, Any], group: RouteGroup | None) -> dict[str, Any]:
    """A request body for `group` carrying the epoch the client knows for it, so that a deposed
    master that still runs refuses it (NOT_MASTER) instead of acknowledging it
    (docs/replication.md, Fencing). Bodies for groups without an epoch are left as they are."""
    if group is None or not group.epoch:
        return body
    return {**body, "epoch": group.epoch}


def static_route(subject: str, brokers: Sequence[str], delay_servers: Sequence[str] = ()) -> Route:
    """The route when broker (and delay server) addresses are given directly: every address is a
    group of its own, named by its address, and always assumed writable (a failed send tries the
    next one). A queue of an ordered subject (`subject#queue`) is on one of them, by its number, so a
    key's messages never spread (docs/ordering.md)."""
    queue = split_queue_subject(subject)
    if queue is not None and brokers:
        brokers = [brokers[queue[1] % len(brokers)]]
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
    """The available delay servers in a META_LIST reply (not the replicas of a replicated group)."""
    return [
        str(s["address"])
        for s in reply.get("servers") or ()
        if s.get("kind") == "delay" and s.get("available", True) and s.get("serves", True)
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


# ---- where a client finds its servers ---------------------------------------------------------------


def resolve_servers(meta: str | None, brokers: Sequence[str] | None) -> tuple[str | None, tuple[str, ...]]:
    """Either a meta server or broker addresses; neither means `$QMQ_META`, else the default meta
    address. Addresses are checked here, so a typo is named before anything is sent."""
    if meta and brokers:
        raise ValueError("give a meta server or broker addresses, not both")
    if brokers:
        for address in brokers:
            parse_address(address)
        return None, tuple(brokers)
    meta = meta or os.environ.get(META_ENV) or DEFAULT_META_ADDRESS
    meta_addresses(meta)
    return meta, ()


def meta_addresses(meta: str) -> list[str]:
    """The meta servers of `A,B,C` (several sharing one database), each checked."""
    addresses = [a.strip() for a in meta.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"{meta!r} names no meta server")
    for address in addresses:
        parse_address(address)
    return addresses


_preferred: dict[str, str] = {}  # meta list -> the address that answered last (shared by clients)


def meta_call(meta: str, code: int, body: dict[str, Any], timeout_s: float) -> Steps[Any]:
    """Ask the meta servers of `meta` (`A,B,C`) in turn, the one that answered last first; the
    first reply, or the last failure (a `RemoteError` or `OSError`, as a `Call` outcome). While
    another is left to ask, one is given META_NEXT_AFTER_S at most: a hung meta server (connection
    open, no answer) holds a send that needs a route that long, not `timeout_s`."""
    addresses = meta_addresses(meta) if "," in meta else [meta]
    first = _preferred.get(meta)
    if first in addresses:
        addresses.remove(first)
        addresses.insert(0, first)
    reply: Any = None
    for n, address in enumerate(addresses, 1):
        reply = yield Call(address, code, body, timeout_s if n == len(addresses) else min(timeout_s, META_NEXT_AFTER_S))
        if not isinstance(reply, RemoteError | OSError):
            _preferred[meta] = address
            return reply
    return reply


def resolve_delay_servers(delay_servers: Sequence[str] | None) -> tuple[str, ...]:
    """Delay server addresses given directly (they take precedence over the meta server's)."""
    for address in delay_servers or ():
        parse_address(address)
    return tuple(delay_servers or ())


def meta_error(meta: str, subject: str, exc: BaseException) -> MetaUnreachable:
    if isinstance(exc, RemoteError):
        return MetaUnreachable(f"the meta server at {meta} could not give a route for {subject!r}: {exc}", exc.code)
    if isinstance(exc, ConnectFailed):
        return MetaUnreachable(f"cannot reach the meta server at {meta}: {exc.reason}", tls_refused=exc.tls_refused)
    return MetaUnreachable(f"cannot reach the meta server at {meta}: {exc}")


def no_route_error(client_meta: str | None, subject: str) -> NoRoute:
    where = f"the meta server at {client_meta}" if client_meta else "the broker list"
    return NoRoute(f"no broker group carries subject {subject!r} ({where} knows none: are brokers running?)")


STATIC_ROUTES_KEPT = 4096  # subjects whose static route is kept (then the cache starts again)


class RouteBook:
    """A client's routes: from the meta server, through a `RouteCache`, or from the addresses given
    directly (`meta` None; each subject's route made once, as it never changes). Thread-safe."""

    def __init__(self, meta: str | None, brokers: Sequence[str] = (), delay_servers: Sequence[str] = ()) -> None:
        self.meta = meta
        self.brokers = tuple(brokers)
        self.delay_servers = tuple(delay_servers)
        self.cache = RouteCache()
        self._static: dict[tuple[str, bool], Route] = {}  # (subject, delayed only) -> its route

    def lookup(self, subject: str, *, refresh: bool = False, delayed_only: bool = False) -> Steps[Route]:
        """The broker groups of `subject`, from the cache while it is fresh (`refresh` asks anyway).
        While the meta server cannot answer, the route fetched before is used for META_RETRY_S before
        asking again; raises `MetaUnreachable` when there is none. `delayed_only` (only delayed
        messages to send) with delay servers given directly needs no meta server at all."""
        if self.meta is None:
            return self._static_route(subject, False)
        if delayed_only and self.delay_servers:
            return self._static_route(subject, True)
        now = time.monotonic()
        if not refresh and (route := self.cache.fresh(subject, now)) is not None:
            return route
        reply = yield from meta_call(self.meta, RequestCode.META_ROUTE, route_request(subject), META_TIMEOUT_S)
        if isinstance(reply, ClientClosed):
            raise reply
        if isinstance(reply, RemoteError | OSError):
            error = meta_error(self.meta, subject, reply)
            stale = self.cache.stale(subject)
            if stale is None:
                raise error from None
            log.warning("%s; using the route fetched before", error)
            self.cache.put(stale, now, META_RETRY_S)
            return stale
        if isinstance(reply, BaseException):
            raise reply
        route = with_delay_servers(parse_route(subject, reply), self.delay_servers)
        self.cache.put(route, now)
        return route

    def _static_route(self, subject: str, delayed_only: bool) -> Route:
        route = self._static.get((subject, delayed_only))
        if route is None:
            if len(self._static) >= STATIC_ROUTES_KEPT:
                self._static.clear()
            route = static_route(subject, () if delayed_only else self.brokers, self.delay_servers)
            self._static[(subject, delayed_only)] = route
        return route

    def invalidate(self, subjects: Iterable[str]) -> None:
        """Ask the meta server again next time (a send to one of their groups failed)."""
        if self.meta is not None:
            self.cache.invalidate(subjects)

    def delay_server_addresses(self) -> Steps[list[str]]:
        """Every delay server to ask (to cancel a delayed message): those given directly, else the
        meta server's available ones. Raises `ClientError` (`MetaUnreachable`) when none is known."""
        if self.delay_servers:
            return list(self.delay_servers)
        if self.meta is None:
            raise ClientError("no delay server is known: give delay_servers=[...] or a meta server")
        reply = yield from meta_call(self.meta, RequestCode.META_LIST, {}, META_TIMEOUT_S)
        if isinstance(reply, RemoteError | OSError):
            raise MetaUnreachable(f"cannot ask the meta server at {self.meta} for delay servers: {reply}")
        if isinstance(reply, BaseException):
            raise reply
        addresses = listed_delay_servers(reply)
        if not addresses:
            raise ClientError(f"the meta server at {self.meta} knows no available delay server")
        return addresses
