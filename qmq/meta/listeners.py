"""The meta server's two listeners, after Kafka's internal and external listeners: a server may
advertise a second address for clients outside its network (`--advertise-external`, e.g. the host of
a docker-compose cluster, where `broker-a:20881` does not resolve), and the meta server's external
listener (`--external-port`) answers with those addresses. Which listener a client connected to
decides what it is told: clients need no setting of their own.

The registry builds each reply once, with both addresses (`addresses` and `external_addresses` per
group, `address` and `external_address` per server); each listener sends its view of it, in which
the addresses are those its clients use and the `external_*` fields are gone. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from qmq.net.server import Handler
from qmq.protocol.codes import RequestCode

# The requests whose replies carry server addresses.
ADDRESSED_REPLIES = frozenset({RequestCode.META_ROUTE, RequestCode.META_LIST})


View = Callable[[int, dict[str, Any] | None], dict[str, Any] | None]


def _view(code: int, reply: dict[str, Any] | None, external: bool) -> dict[str, Any] | None:
    if reply is None or code not in ADDRESSED_REPLIES:
        return reply
    view = dict(reply)
    if "groups" in view:
        view["groups"] = [_group(g, external) for g in view["groups"]]
    if external and view.get("replication"):
        outside = {s["address"]: s["external_address"] for s in view.get("servers", ()) if s.get("external_address")}
        view["replication"] = [_replicated(g, outside) for g in view["replication"]]
    for key in ("delay_servers", "servers"):
        if key in view:
            view[key] = [_server(s, external) for s in view[key]]
    return view


def _replicated(group: dict[str, Any], outside: dict[str, str]) -> dict[str, Any]:
    """A replicated group of META_LIST with its members' outside addresses (`qmq admin group show`
    from outside the servers' network)."""
    view = dict(group)
    view["master"] = outside.get(group["master"], group["master"])
    view["in_sync"] = [outside.get(a, a) for a in group.get("in_sync", ())]
    view["members"] = [{**m, "address": outside.get(m["address"], m["address"])} for m in group.get("members", ())]
    return view


def _group(group: dict[str, Any], external: bool) -> dict[str, Any]:
    view = {k: v for k, v in group.items() if k != "external_addresses"}
    if external and group.get("external_addresses"):
        view["addresses"] = list(group["external_addresses"])
    return view


def _server(server: dict[str, Any], external: bool) -> dict[str, Any]:
    view = {k: v for k, v in server.items() if k != "external_address"}
    if external and server.get("external_address"):
        view["address"] = server["external_address"]
    return view


def internal_view(code: int, reply: dict[str, Any] | None) -> dict[str, Any] | None:
    """`reply` to request `code` as the internal listener sends it: the servers' own addresses."""
    return _view(code, reply, external=False)


def external_view(code: int, reply: dict[str, Any] | None) -> dict[str, Any] | None:
    """`reply` to request `code` as the external listener sends it: every server address replaced by
    the one it advertises for outside clients (its own address when it advertises none)."""
    return _view(code, reply, external=True)


def viewed(handler: Handler, view: View) -> Handler:
    """`handler` with `view` applied to its replies: what one listener serves."""

    async def handle(request, peer):
        return view(request.code, await handler(request, peer))

    return handle
