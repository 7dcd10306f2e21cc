"""Administration calls, shared by `qmq admin` and `qmq console`: the cluster as the meta server sees
it, and the brokers' and delay servers' administration requests (docs/broker.md, docs/delay.md),
asked of every group concerned at once.

`AdminCore` is a mixin of the client core (it uses its settings: `meta`, `brokers`, `delay_servers`):
each operation is a loop of steps (`qmq.client.steps`), bound once in each driver (`Admin` in
`blocking.py`, `AsyncAdmin` in `aio.py`). Nothing here does I/O. An operation that asks several
servers returns one `Answer` per server, with its reply or the error that stood in its way, so that
one broker down never hides what the others said.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from qmq.client.errors import ClientError, MetaUnreachable
from qmq.client.routes import meta_call
from qmq.client.steps import Call, Calls, Sleep, Steps
from qmq.protocol.codes import RequestCode
from qmq.protocol.limits import DELAY_GROUP_PREFIX

ADMIN_TIMEOUT_S = 30.0  # an administration request (a look-up reads the journal; a re-drive appends)
MAX_DEAD_SELECTED = 4096  # dead letters listed to choose some by id (a broker's most in one reply)


@dataclass(frozen=True)
class BrokerGroup:
    """A broker group as the meta server lists it (or one broker given directly)."""

    name: str
    addresses: tuple[str, ...]
    available: bool = True
    read_only: bool = False
    subjects: int = 0
    master: str | None = None  # the server that takes writes, once groups replicate (issue 14)

    @property
    def address(self) -> str | None:
        """Where the group's administration requests go: its master, else its first live server."""
        return self.master or (self.addresses[0] if self.addresses else None)


@dataclass(frozen=True)
class Cluster:
    """What the meta server knows (META_LIST), or the servers given directly when there is none."""

    meta: str | None
    groups: tuple[BrokerGroup, ...]
    delay_servers: tuple[dict[str, Any], ...]  # {"address", "available", ...}
    servers: tuple[dict[str, Any], ...] = ()  # every registered server, as META_LIST lists it
    routes: dict[str, list[str]] = field(default_factory=dict)  # subject -> group names
    raw: dict[str, Any] = field(default_factory=dict)  # the META_LIST reply

    def groups_for(self, subject: str | None) -> tuple[BrokerGroup, ...]:
        """The groups that carry `subject` (all when the subject has no route, or is None)."""
        names = self.routes.get(subject or "")
        if not names:
            return self.groups
        return tuple(g for g in self.groups if g.name in names)


@dataclass(frozen=True)
class Answer:
    """One server's answer: its reply, or why there is none."""

    group: str
    address: str
    reply: dict[str, Any] | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def parse_cluster(meta: str, reply: dict[str, Any]) -> Cluster:
    groups = tuple(
        BrokerGroup(
            name=str(g["name"]),
            addresses=tuple(str(a) for a in g.get("addresses") or ()),
            available=bool(g.get("available", True)),
            read_only=bool(g.get("read_only", False)),
            subjects=int(g.get("subjects") or 0),
            master=g.get("master"),
        )
        for g in reply.get("groups") or ()
    )
    servers = tuple(reply.get("servers") or ())
    delay = tuple(s for s in servers if s.get("kind") == "delay")
    routes = {str(r["subject"]): [str(n) for n in r.get("groups") or ()] for r in reply.get("routes") or ()}
    return Cluster(meta, groups, delay, servers, routes, reply)


def static_cluster(brokers: Iterable[str], delay_servers: Iterable[str]) -> Cluster:
    """Servers given directly: each broker is a group of its own, named by its address."""
    return Cluster(
        None,
        tuple(BrokerGroup(a, (a,)) for a in brokers),
        tuple({"address": a, "kind": "delay", "available": True} for a in delay_servers),
    )


def answers(targets: list[tuple[str, str]], replies: list[Any]) -> list[Answer]:
    """(group, address) targets and their outcomes as `Answer`s."""
    out = []
    for (group, address), reply in zip(targets, replies, strict=True):
        if isinstance(reply, BaseException):
            out.append(Answer(group, address, error=describe_error(reply)))
        else:
            out.append(Answer(group, address, reply=reply or {}))
    return out


def describe_error(exc: BaseException) -> str:
    """An error as an operator reads it: the server's code and message, or what stood in the way."""
    return str(exc) or type(exc).__name__


# The operations of AdminCore, which each driver binds as its methods (`qmq.client.steps.bound`).
ADMIN_OPERATIONS = (
    "cluster",
    "stats",
    "delay_stats",
    "consumers",
    "dead_list",
    "redrive",
    "purge",
    "reset",
    "group_create",
    "group_delete",
    "lookup",
    "failover",
    "credential_create",
    "credential_list",
    "credential_revoke",
)


class AdminCore:
    """The administration operations, as loops of steps over the client core's settings."""

    meta: str | None
    brokers: tuple[str, ...]
    delay_servers: tuple[str, ...]

    def failover(self, group: str, to: str | None = None, timeout_s: float = 30.0) -> Steps[dict]:
        """A manual switch of a replicated group's master (`failover_steps` below)."""
        return failover_steps(self, group, to, timeout_s)

    def cluster(self) -> Steps[Cluster]:
        """The cluster: META_LIST from the meta server, or the servers given directly. Raises
        `MetaUnreachable` when the meta server cannot answer."""
        if self.meta is None:
            return static_cluster(self.brokers, self.delay_servers)
        reply = yield from meta_call(self.meta, RequestCode.META_LIST, {}, ADMIN_TIMEOUT_S)
        if isinstance(reply, BaseException):
            raise MetaUnreachable(f"cannot ask the meta server at {self.meta}: {describe_error(reply)}")
        cluster = parse_cluster(self.meta, reply)
        if self.delay_servers:
            cluster = Cluster(
                cluster.meta,
                cluster.groups,
                tuple({"address": a, "kind": "delay", "available": True} for a in self.delay_servers),
                cluster.servers,
                cluster.routes,
                cluster.raw,
            )
        return cluster

    def _ask(self, targets: list[tuple[str, str]], code: int, body: dict[str, Any]) -> Steps[list[Answer]]:
        """One request to each (group, address) at once."""
        if not targets:
            return []
        replies = yield Calls([Call(address, code, body, ADMIN_TIMEOUT_S) for _group, address in targets])
        return answers(targets, replies)

    def _ask_groups(
        self,
        code: int,
        body: dict[str, Any],
        subject: str | None = None,
        every_server: bool = False,
        cluster: Cluster | None = None,
    ) -> Steps[list[Answer]]:
        """A request to every broker group that carries `subject` (one server each, or every server)."""
        if cluster is None:
            cluster = yield from AdminCore.cluster(self)
        targets = []
        for group in cluster.groups_for(subject):
            if every_server:
                targets.extend((group.name, a) for a in group.addresses)
            elif group.address is not None:
                targets.append((group.name, group.address))
        return (yield from self._ask(targets, code, body))

    def _ask_delay_servers(
        self, code: int, body: dict[str, Any], cluster: Cluster | None = None
    ) -> Steps[list[Answer]]:
        if cluster is None:
            cluster = yield from AdminCore.cluster(self)
        targets = [(str(s["address"]), str(s["address"])) for s in cluster.delay_servers if s.get("available", True)]
        return (yield from self._ask(targets, code, body))

    # ---- figures --------------------------------------------------------------------------------

    def stats(self) -> Steps[list[Answer]]:
        """BROKER_STATS of every broker server (each server of a replicated group answers for itself:
        its role and lag, when the brokers report them)."""
        return self._ask_groups(RequestCode.BROKER_STATS, {}, every_server=True)

    def delay_stats(self) -> Steps[list[Answer]]:
        """DELAY_STATS of every available delay server (pending messages per hour bucket ahead)."""
        return self._ask_delay_servers(RequestCode.DELAY_STATS, {})

    def consumers(self) -> Steps[list[Answer]]:
        """BROKER_CONSUMERS of every broker group: consumers and their workers' reports."""
        return self._ask_groups(RequestCode.BROKER_CONSUMERS, {})

    # ---- dead letters ---------------------------------------------------------------------------

    def dead_list(self, subject: str, group: str, max_count: int = 100) -> Steps[list[Answer]]:
        """The dead letters of (`subject`, `group`) not yet re-driven or purged, per broker group."""
        return self._ask_groups(
            RequestCode.BROKER_DEAD_LIST, {"subject": subject, "group": group, "max": max_count}, subject
        )

    def redrive(self, subject: str, group: str, seqs: dict[str, list[int]] | None = None) -> Steps[list[Answer]]:
        """Send dead letters back to their group: all of them, or `seqs` by broker group name."""
        return self._dead_action(RequestCode.BROKER_DEAD_REDRIVE, subject, group, seqs)

    def purge(self, subject: str, group: str, seqs: dict[str, list[int]] | None = None) -> Steps[list[Answer]]:
        """Drop dead letters: all of them, or `seqs` by broker group name."""
        return self._dead_action(RequestCode.BROKER_DEAD_PURGE, subject, group, seqs)

    def _dead_action(
        self, code: int, subject: str, group: str, seqs: dict[str, list[int]] | None
    ) -> Steps[list[Answer]]:
        body = {"subject": subject, "group": group}
        if seqs is None:
            return (yield from self._ask_groups(code, body, subject))
        cluster = yield from AdminCore.cluster(self)
        by_name = {g.name: g for g in cluster.groups}
        unknown = sorted(set(seqs) - set(by_name))
        if unknown:
            raise ClientError(f"no broker group named {', '.join(unknown)}")
        targets, calls = [], []
        for name, chosen in seqs.items():
            address = by_name[name].address
            if address is None:
                raise ClientError(f"broker group {name} has no server")
            targets.append((name, address))
            calls.append(Call(address, code, {**body, "seqs": list(chosen)}, ADMIN_TIMEOUT_S))
        replies = yield Calls(calls)
        return answers(targets, replies)

    # ---- positions and groups -------------------------------------------------------------------

    def reset(
        self, subject: str, group: str, to: str | int = "latest", time_ms: int | None = None
    ) -> Steps[list[Answer]]:
        """Move the group's cursor on every broker group of the subject: "earliest", "latest", a
        sequence (one broker group only makes sense), or the first message stored at `time_ms`."""
        return self._ask_groups(RequestCode.BROKER_RESET, position_body(subject, group, to, time_ms), subject)

    def group_create(
        self, subject: str, group: str, to: str | int = "latest", time_ms: int | None = None
    ) -> Steps[list[Answer]]:
        """Make the consumer group on every broker group of the subject, starting where asked."""
        return self._ask_groups(RequestCode.BROKER_GROUP_CREATE, position_body(subject, group, to, time_ms), subject)

    def group_delete(self, subject: str, group: str, force: bool = False) -> Steps[list[Answer]]:
        """Delete the consumer group everywhere (refused while its consumers live, unless `force`)."""
        return self._ask_groups(RequestCode.BROKER_GROUP_DELETE, {"subject": subject, "group": group, "force": force})

    # ---- look-up --------------------------------------------------------------------------------

    def lookup(
        self, message_id: str | None = None, subject: str | None = None, key: str | None = None
    ) -> Steps[tuple[list[Answer], list[Answer]]]:
        """A message by id, or the messages of (`subject`, `key`): the brokers' answers (copies and
        life) and the delay servers' (a delayed message not yet delivered)."""
        if message_id is not None:
            body: dict[str, Any] = {"id": message_id}
        elif subject is not None and key is not None:
            body = {"subject": subject, "key": key}
        else:
            raise ValueError("look up a message by id, or by subject and key")
        cluster = yield from AdminCore.cluster(self)
        brokers = yield from self._ask_groups(RequestCode.BROKER_LOOKUP, body, cluster=cluster)
        delayed = yield from self._ask_delay_servers(RequestCode.DELAY_LOOKUP, body, cluster)
        return brokers, delayed

    # ---- per-application credentials (the meta server keeps them; docs/security.md) ----------------

    def credential_create(
        self, app: str, produce: Iterable[str] = (), consume: Iterable[str] = (), admin: bool = False
    ) -> Steps[dict[str, Any]]:
        """A new credential for `app`: its id, rights and token (shown this once)."""
        body = {"app": app, "produce": list(produce), "consume": list(consume), "admin": admin}
        return (yield from self._ask_meta(RequestCode.META_CREDENTIAL_CREATE, body))

    def credential_list(self) -> Steps[list[dict[str, Any]]]:
        """Every credential, revoked ones included (never a secret)."""
        reply = yield from self._ask_meta(RequestCode.META_CREDENTIAL_LIST, {})
        return reply.get("credentials", [])

    def credential_revoke(self, credential_id: str) -> Steps[bool]:
        """Revoke a credential: refused everywhere within the servers' check cache (10 s)."""
        reply = yield from self._ask_meta(RequestCode.META_CREDENTIAL_REVOKE, {"id": credential_id})
        return bool(reply.get("revoked"))

    def _ask_meta(self, code: int, body: dict[str, Any]) -> Steps[dict[str, Any]]:
        if self.meta is None:
            raise ClientError("credentials are kept by the meta server: give --meta")
        reply = yield Call(self.meta, code, body, ADMIN_TIMEOUT_S)
        if isinstance(reply, BaseException):
            raise ClientError(f"the meta server at {self.meta}: {describe_error(reply)}")
        return reply or {}


def position_body(subject: str, group: str, to: str | int, time_ms: int | None) -> dict[str, Any]:
    body: dict[str, Any] = {"subject": subject, "group": group, "to": to}
    if time_ms is not None:
        body["time_ms"] = time_ms
    return body


FAILOVER_TIMEOUT_S = 30.0  # a manual failover gives up after this long
FAILOVER_POLL_S = 0.1  # how often it looks whether the new master has taken office


class FailoverError(ClientError):
    """A manual failover could not be made (no such group, no replica caught up, timed out)."""


def failover_steps(admin: Any, group: str, to: str | None = None, timeout_s: float = FAILOVER_TIMEOUT_S) -> Steps[dict]:
    """`qmq admin failover`: a manual switch of a replicated group's master (docs/replication.md); a
    delay-server group is named `delay:NAME`, as META_LIST lists it.
    The master stops taking sends and waits until a replica (`to`, or the in-sync one) has all of its
    log; then the meta server makes that replica master with the next epoch; returns once it serves."""
    if admin.meta is None:
        raise FailoverError("a failover needs the meta server (--meta)")
    listing = yield from meta_call(admin.meta, RequestCode.META_LIST, {}, ADMIN_TIMEOUT_S)
    if isinstance(listing, BaseException):
        raise MetaUnreachable(f"cannot ask the meta server at {admin.meta}: {describe_error(listing)}")
    entry = next((g for g in listing.get("replication") or () if g["group"] == group), None)
    if entry is None:
        raise FailoverError(f"group {group!r} is not a replicated group the meta server knows")
    old = entry["master"]
    body = {"timeout_ms": int(timeout_s * 1000), **({"to": to} if to else {})}
    handoff = yield Call(old, RequestCode.REPL_HANDOFF, body, timeout_s + ADMIN_TIMEOUT_S)
    if isinstance(handoff, BaseException):
        raise FailoverError(f"master {old} of {group} did not hand off: {describe_error(handoff)}")
    switch = {"group": group, "to": handoff["replica"]}
    switched = yield from meta_call(admin.meta, RequestCode.REPL_SWITCH, switch, ADMIN_TIMEOUT_S)
    if isinstance(switched, BaseException):
        raise FailoverError(f"the meta server did not switch {group}: {describe_error(switched)}")
    new = switched["master"]
    stats_code = RequestCode.DELAY_STATS if group.startswith(DELAY_GROUP_PREFIX) else RequestCode.BROKER_STATS
    waited = 0.0
    while True:
        stats = yield Call(new, stats_code, {}, ADMIN_TIMEOUT_S)
        replication = stats.get("replication") if isinstance(stats, dict) else None
        if replication and replication.get("role") == "master" and replication.get("epoch") == switched["epoch"]:
            break
        if waited >= timeout_s:
            raise FailoverError(f"{new} was made master of {group} (epoch {switched['epoch']}) but does not serve yet")
        yield Sleep(FAILOVER_POLL_S)
        waited += FAILOVER_POLL_S
    return {"group": group, "old_master": old, "master": new, "epoch": switched["epoch"], "end": handoff["end"]}
