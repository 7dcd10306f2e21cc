"""The members of a replicated group (docs/replication.md), for `qmq admin group show` and
`qmq admin group forget`: what the meta server last heard from each (META_LIST) joined with what
each member says of itself and what the master says of its replicas (BROKER_STATS, or DELAY_STATS
for a delay-server group, named `delay:NAME` as META_LIST lists it), and the removal of a member
gone for good (REPL_FORGET).

Each operation is a loop of steps (`qmq.client.steps`), run by a client driver
(`qmq.client.blocking.blocking`), like the client's own administration calls. No I/O here.
"""

from __future__ import annotations

from typing import Any

from qmq.client.admin import ADMIN_TIMEOUT_S, describe_error
from qmq.client.errors import ClientError, MetaUnreachable
from qmq.client.routes import meta_call
from qmq.client.steps import Call, Calls, Sleep, Steps
from qmq.protocol.codes import RequestCode
from qmq.protocol.limits import DELAY_GROUP_PREFIX

FORGET_SETTLE_S = 15.0  # how long `forget` waits for the master to drop the forgotten replica
FORGET_POLL_S = 0.1  # how often it asks the master meanwhile


class MembersError(ClientError):
    """A replicated group's members could not be shown or changed (the message says why)."""


def stats_code(group: str) -> int:
    """The stats request the members of `group` answer: delay servers or brokers."""
    return RequestCode.DELAY_STATS if group.startswith(DELAY_GROUP_PREFIX) else RequestCode.BROKER_STATS


def _need_meta(admin: Any) -> str:
    if admin.meta is None:
        raise MembersError("a replicated group's members are known to the meta server: give --meta")
    return admin.meta


def _entry(admin: Any, group: str) -> Steps[dict[str, Any]]:
    """The meta server's listing of `group` (epoch, master, in_sync, members)."""
    meta = _need_meta(admin)
    listing = yield from meta_call(meta, RequestCode.META_LIST, {}, ADMIN_TIMEOUT_S)
    if isinstance(listing, BaseException):
        raise MetaUnreachable(f"cannot ask the meta server at {meta}: {describe_error(listing)}")
    for entry in listing.get("replication") or ():
        if entry["group"] == group:
            return entry
    known = ", ".join(e["group"] for e in listing.get("replication") or ()) or "none"
    raise MembersError(f"group {group!r} is not a replicated group the meta server knows (known: {known})")


def ack_rule(master_stats: dict[str, Any] | None) -> dict[str, Any]:
    """What a send needs now, from the master's replication stats: {"ack_replicas", "in_sync",
    "writable", "text"}. None stats: the master did not answer."""
    if not master_stats:
        return {"ack_replicas": None, "in_sync": None, "writable": None, "text": "unknown (the master did not answer)"}
    needed = int(master_stats.get("ack_replicas", 0))
    replicas = master_stats.get("replicas") or []
    in_sync = sum(1 for r in replicas if r.get("in_sync"))
    writable = master_stats.get("writable")
    if needed == 0:
        text = "a send is acknowledged once the master alone has it durable (no replica needed)"
    else:
        text = f"a send needs the master and {needed} replica(s) durable; {in_sync} in sync"
        if not writable:
            text += ": sends are refused (READ_ONLY) until enough replicas are in sync"
    return {"ack_replicas": needed, "in_sync": in_sync, "writable": writable, "text": text}


def show(admin: Any, group: str) -> Steps[dict[str, Any]]:
    """`qmq admin group show`: {"group", "epoch", "master", "ack_rule", "members": one row per member
    (role, epoch, log end, durable offset, in sync, lag, last report), "errors"}."""
    entry = yield from _entry(admin, group)
    reported = {m["address"]: m for m in entry.get("members") or ()}
    addresses = sorted(reported, key=lambda a: (a != entry["master"], a))
    if entry["master"] not in reported:
        addresses.insert(0, entry["master"])
    calls = [Call(a, stats_code(group), {}, ADMIN_TIMEOUT_S) for a in addresses]
    replies = (yield Calls(calls)) if calls else []
    own = {a: r.get("replication") or {} for a, r in zip(addresses, replies, strict=True) if isinstance(r, dict)}
    errors = [
        {"group": group, "address": a, "error": describe_error(r)}
        for a, r in zip(addresses, replies, strict=True)
        if isinstance(r, BaseException)
    ]
    master_stats = own.get(entry["master"])
    seen_by_master = {r["address"]: r for r in (master_stats or {}).get("replicas") or ()}
    members = []
    for address in addresses:
        report, stats, follower = reported.get(address, {}), own.get(address), seen_by_master.get(address, {})
        is_master = address == entry["master"]
        members.append(
            {
                "address": address,
                "role": "master" if is_master else "replica",
                "says": stats.get("role") if stats else "unreachable",
                "epoch": stats.get("epoch") if stats else report.get("epoch"),
                "log_end": stats.get("log_end") if stats else report.get("log_end"),
                "durable": stats.get("durable") if stats else None,
                "in_sync": None if is_master else bool(follower.get("in_sync")),
                "lag_bytes": None if is_master else follower.get("lag_bytes"),
                "lag_s": None if is_master else follower.get("lag_s"),
                "reported_s_ago": report.get("reported_s_ago"),
            }
        )
    return {
        "group": group,
        "epoch": entry["epoch"],
        "master": entry["master"],
        "ack_rule": ack_rule(master_stats),
        "members": members,
        "errors": errors,
    }


def forget(admin: Any, group: str, address: str, force: bool = False) -> Steps[dict[str, Any]]:
    """`qmq admin group forget`: the meta server removes `address` from `group` (refused for the
    master, or for a member that reported lately without `force`); then this waits (up to
    FORGET_SETTLE_S) until the master no longer lists it, and returns what the ack rule needs now."""
    meta = _need_meta(admin)
    body = {"group": group, "address": address, "force": force}
    done = yield from meta_call(meta, RequestCode.REPL_FORGET, body, ADMIN_TIMEOUT_S)
    if isinstance(done, BaseException):
        raise MembersError(f"the meta server did not forget {address}: {describe_error(done)}")
    master, waited, stats, dropped = done["master"], 0.0, None, False
    while True:
        reply = yield Call(master, stats_code(group), {}, ADMIN_TIMEOUT_S)
        stats = reply.get("replication") if isinstance(reply, dict) else None
        dropped = bool(stats) and all(r["address"] != address for r in stats.get("replicas") or ())
        if dropped or waited >= FORGET_SETTLE_S:
            break
        yield Sleep(FORGET_POLL_S)
        waited += FORGET_POLL_S
    return {**done, "master_dropped": dropped, "ack_rule": ack_rule(stats)}
