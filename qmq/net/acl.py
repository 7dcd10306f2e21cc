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
from qmq.protocol.ordering import base_subject

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
    """The user subject behind a stored subject (`%RETRY%subject%group` -> `subject`, an ordered
    subject's queue `subject#7` -> `subject`)."""
    for prefix in SYSTEM_PREFIXES:
        if stored.startswith(prefix):
            stored = stored[len(prefix) :].split("%", 1)[0]
            break
    return base_subject(stored)


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
            if isinstance(subject, str) and not principal.may_produce(base_subject(subject)):
                raise forbidden(f"application {principal.app!r} may not produce to {subject[:200]!r}")
        return
    if code == RequestCode.DELAY_CANCEL:
        if not principal.produce:
            raise forbidden(f"application {principal.app!r} produces nothing, so it may cancel nothing")
        return
    consumed = _consumed(code, body)
    if consumed is not None:
        for stored, key in consumed:
            _consume(principal, stored, key)
        return
    try:
        name = RequestCode(code).name
    except ValueError:
        return  # an unknown code: the server answers UNKNOWN_REQUEST
    raise forbidden(f"application {principal.app!r} may not {name} (an admin credential or the shared token may)")


# consuming requests that name [stored subject, group key, ...] items, and the body's list of them
_CONSUMER_ITEMS = {
    RequestCode.BROKER_ACK: "acks",
    RequestCode.BROKER_HEARTBEAT: "consumers",
    RequestCode.BROKER_LEAVE: "leaves",
}


def _consumed(code: int, body: dict[str, Any]) -> list[tuple[Any, Any]] | None:
    """The (stored subject, group key) pairs a consuming request names; None for other requests."""
    if code in (RequestCode.BROKER_PULL, RequestCode.BROKER_QUEUE_LOCK):
        return [(body.get("subject"), body.get("group"))]
    if code in _CONSUMER_ITEMS:
        items = _list(body.get(_CONSUMER_ITEMS[code]))
        return [(i[0], i[1]) for i in items if isinstance(i, list) and len(i) >= 2]
    if code == RequestCode.BROKER_NACK:
        return [(i.get("subject"), i.get("group")) for i in _list(body.get("nacks")) if isinstance(i, dict)]
    return None


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _consume(principal: Principal, stored: Any, key: Any) -> None:
    if not (isinstance(stored, str) and isinstance(key, str)):
        return
    subject, group = original_subject(stored), consumer_group(key)
    if not principal.may_consume(subject, group):
        raise forbidden(f"application {principal.app!r} may not consume {subject[:200]!r} as group {group[:64]!r}")
