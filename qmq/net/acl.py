"""Who may do what: the principal a connection authenticated as, and the check of each request
against it. No I/O.

A connection that presented the shared token (`QMQ_TOKEN`), or any connection to a server without a
token, has no principal and may do everything. One that presented a per-application credential
(`qmq admin credentials create`) has a `Principal`: it may produce to the subjects its `produce`
patterns match and consume as the 'subject:group' pairs its `consume` patterns match (fnmatch
patterns: `order.*`, `order.created:billing`, `*:audit`); routes and pings are open to it; anything
else (administration, registration of servers, other credentials) needs `admin`. A request it may
not make is answered FORBIDDEN naming what was refused; the connection stays usable.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase
from typing import Any

from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError

SYSTEM_PREFIXES = ("%RETRY%", "%DEAD%")


@dataclass(frozen=True)
class Principal:
    """An application's rights, as the meta server keeps them."""

    id: str
    app: str
    produce: tuple[str, ...] = ()
    consume: tuple[str, ...] = ()
    admin: bool = False

    def may_produce(self, subject: str) -> bool:
        return self.admin or any(fnmatchcase(subject, pattern) for pattern in self.produce)

    def may_consume(self, subject: str, group: str) -> bool:
        pair = f"{subject}:{group}"
        return self.admin or any(fnmatchcase(pair, pattern) for pattern in self.consume)

    def to_wire(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "app": self.app,
            "produce": list(self.produce),
            "consume": list(self.consume),
            "admin": self.admin,
        }

    @classmethod
    def from_wire(cls, body: dict[str, Any]) -> Principal:
        return cls(
            str(body["id"]),
            str(body["app"]),
            tuple(str(p) for p in body.get("produce") or ()),
            tuple(str(p) for p in body.get("consume") or ()),
            bool(body.get("admin")),
        )


def forbidden(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.FORBIDDEN, message, fatal=False)


def original_subject(stored: str) -> str:
    """The user subject behind a stored subject (`%RETRY%subject%group` -> `subject`)."""
    for prefix in SYSTEM_PREFIXES:
        if stored.startswith(prefix):
            return stored[len(prefix) :].split("%", 1)[0]
    return stored


def consumer_group(key: str) -> str:
    """The consumer group behind a group key (a broadcast consumer's key is `group.bc-<hash>`)."""
    group, sep, tail = key.rpartition(".bc-")
    return group if sep and len(tail) == 12 else key


OPEN_CODES = frozenset({RequestCode.PING, RequestCode.META_ROUTE})


def authorize(principal: Principal, code: int, body: dict[str, Any]) -> None:
    """Raise FORBIDDEN unless `principal` may make request `code` with `body`. Fields of the wrong
    shape are left for the handler to refuse: this only refuses what is well-formed and not allowed."""
    if principal.admin or code in OPEN_CODES:
        return
    if code in (RequestCode.BROKER_SEND, RequestCode.DELAY_SEND):
        messages = body.get("messages")
        for item in messages if isinstance(messages, list) else ():
            subject = item.get("subject") if isinstance(item, dict) else None
            if isinstance(subject, str) and not principal.may_produce(subject):
                raise forbidden(f"application {principal.app!r} may not produce to {subject[:200]!r}")
        return
    if code == RequestCode.DELAY_CANCEL:
        if not principal.produce:
            raise forbidden(f"application {principal.app!r} produces nothing, so it may cancel nothing")
        return
    if code == RequestCode.BROKER_PULL:
        _consume(principal, body.get("subject"), body.get("group"))
        return
    if code == RequestCode.BROKER_ACK:
        for item in _list(body.get("acks")):
            if isinstance(item, list) and len(item) >= 2:
                _consume(principal, item[0], item[1])
        return
    if code == RequestCode.BROKER_NACK:
        for item in _list(body.get("nacks")):
            if isinstance(item, dict):
                _consume(principal, item.get("subject"), item.get("group"))
        return
    if code == RequestCode.BROKER_HEARTBEAT:
        for item in _list(body.get("consumers")):
            if isinstance(item, list) and len(item) >= 2:
                _consume(principal, item[0], item[1])
        return
    try:
        name = RequestCode(code).name
    except ValueError:
        return  # an unknown code: the server answers UNKNOWN_REQUEST
    raise forbidden(f"application {principal.app!r} may not {name} (an admin credential or the shared token may)")


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _consume(principal: Principal, stored: Any, key: Any) -> None:
    if not (isinstance(stored, str) and isinstance(key, str)):
        return
    subject, group = original_subject(stored), consumer_group(key)
    if not principal.may_consume(subject, group):
        raise forbidden(f"application {principal.app!r} may not consume {subject[:200]!r} as group {group[:64]!r}")
