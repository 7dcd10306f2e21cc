"""`qmq.Producer`: sending a message as part of the application's database transaction.

`send` writes an outbox row in the open transaction (an `@qmq.transactional` block, or a Django
`atomic` block), so the message commits or rolls back with the business rows. After the commit the
in-process sender ships it at once; the relay (`qmq relay`) ships whatever the sender could not.
Outside any transaction, `send` writes and commits the row on its own, then ships it the same way.

Promises: `send` returns the message's id, made before the commit (the id consumers and the nightly
reconciliation see); it raises only for a message that could never be delivered (bad subject, tags,
key, body or size) or for a database error of the insert itself; a broker that is down never makes it
raise or block.
"""

from __future__ import annotations

import atexit
import os
import socket
import uuid
import weakref
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, scoped_session

from qmq.client.blocking import Client
from qmq.client.core import InvalidMessage, OutgoingMessage
from qmq.outbox import context
from qmq.outbox.context import OutboxTransaction
from qmq.outbox.notify import NOTIFY_SQL
from qmq.outbox.rows import insert
from qmq.outbox.sender import Sender
from qmq.outbox.shipping import Shipment
from qmq.protocol import envelope
from qmq.protocol.errors import ErrorCode
from qmq.protocol.limits import MAX_MESSAGE_BYTES

INSERT_LEASE_S = 10.0  # a new row is left to its own sender this long; then any relay may ship it
MAX_DELAY = timedelta(days=730)  # the delay server's default limit: two years


class Producer:
    """Sends messages in the application's transactions; one per database.

    Say which database with one of: `engine` (a SQLAlchemy Engine), `session` (a Session factory or
    Flask-SQLAlchemy's `db.session`, used by `@qmq.transactional` when the function is not given one),
    `using` (a Django database alias). `meta` (or `brokers` and `delay_servers`, lists of "host:port")
    says where to ship. `after_commit=False` leaves every message to the relay (woken by NOTIFY)."""

    def __init__(
        self,
        meta: str | None = None,
        *,
        engine: sa.Engine | None = None,
        session: Any = None,
        using: str | None = None,
        brokers: Sequence[str] | None = None,
        delay_servers: Sequence[str] | None = None,
        token: str | None = None,
        after_commit: bool = True,
        insert_lease_s: float = INSERT_LEASE_S,
    ) -> None:
        if engine is None and session is None and using is None:
            raise ValueError("a Producer needs its database: engine=, session= or (Django) using=")
        self.meta = meta or os.environ.get("QMQ_META")
        self.brokers = list(brokers) if brokers else None
        self.delay_servers = list(delay_servers) if delay_servers else None
        if not self.meta and not self.brokers:
            raise ValueError("a Producer needs meta='host:port' (or $QMQ_META) or brokers=[...]")
        self.engine = engine
        self.session = session
        self.using = using
        self.token = token if token is not None else os.environ.get("QMQ_TOKEN")
        self.after_commit = after_commit
        self.insert_lease_s = insert_lease_s
        self._learned_engine: sa.Engine | None = None
        self._database_name: str | None = None
        self._sender: Sender | None = None
        _live_producers.add(self)

    # ---- sending -----------------------------------------------------------------------------------

    def send(
        self,
        subject: str,
        body: Any,
        *,
        key: str | None = None,
        tags: Sequence[str] = (),
        headers: Mapping[str, str] | None = None,
        delay: float | timedelta | None = None,
        deliver_at: datetime | None = None,
    ) -> str:
        """Write `body` for `subject` into the current transaction's outbox; return the message id.
        Bodies: bytes, str, or anything JSON can encode (the content type is recorded). With `delay`
        (seconds or a timedelta) or `deliver_at` (an aware datetime), the message goes to the delay
        server and is delivered then, never before."""
        when = _deliver_at(delay, deliver_at)
        raw, content_type = envelope.encode_body(body)
        transaction = context.current(self) or self._joinable_transaction()
        headers = {**(headers or {}), envelope.PRODUCER_HEADER: f"outbox:{self.database_name()}"}
        message = OutgoingMessage(
            subject, raw, key=key, tags=tuple(tags), headers=headers, content_type=content_type, deliver_at=when
        )
        payload = message.to_wire()["payload"]  # raises InvalidMessage now, in the caller, for what a broker...
        if len(payload) > MAX_MESSAGE_BYTES:  # ...would refuse, rather than in the relay, forever
            raise InvalidMessage(
                ErrorCode.MESSAGE_TOO_LARGE, f"message is {len(payload)} bytes, the limit is {MAX_MESSAGE_BYTES}"
            )
        values = {
            "message_id": message.id,
            "subject": subject,
            "body": raw,
            "content_type": content_type,
            "headers": message.headers,
            "tags": list(message.tags) or None,
            "key": key,
            "deliver_at": when,
        }
        if transaction is None:
            self._send_alone(values, Shipment(message))
        else:
            self._write(transaction, values, Shipment(message))
        return message.id

    def _write(self, transaction: OutboxTransaction, values: dict[str, Any], shipment: Shipment) -> None:
        lease = self.sender.token if self.after_commit and self.sender.has_room() else None
        transaction.insert(values, lease, self.insert_lease_s)
        if lease is None:
            transaction.notify()
        else:
            transaction.after_commit(shipment)

    def _joinable_transaction(self) -> OutboxTransaction | None:
        """A transaction the application opened without `@transactional`: a Django `atomic` block."""
        if self.using is None:
            return None
        from qmq.contrib.django.tx import DjangoTransaction, in_atomic_block

        return DjangoTransaction(self, self.using) if in_atomic_block(self.using) else None

    def _send_alone(self, values: dict[str, Any], shipment: Shipment) -> None:
        """Outside any transaction: the row is written and committed on its own, then shipped."""
        if self.using is not None:
            from qmq.contrib.django.tx import DjangoTransaction, atomic

            with atomic(self.using):
                self._write(DjangoTransaction(self, self.using), values, shipment)
            return
        engine = self.sender_engine()
        lease = self.sender.token if self.after_commit and self.sender.has_room() else None
        with engine.begin() as conn:
            params = {**values, "lease_token": lease, "lease_s": self.insert_lease_s} if lease else values
            conn.execute(insert(conn.dialect.name, lease is not None), params)
            if lease is None and conn.dialect.name == "postgresql":
                conn.execute(sa.text(NOTIFY_SQL))
        if lease is not None:
            self.handoff([shipment])

    # ---- after the commit --------------------------------------------------------------------------

    @property
    def sender(self) -> Sender:
        if self._sender is None:
            self._sender = Sender(
                self.sender_engine, self._new_client, token=str(uuid.uuid4()), lease_s=self.insert_lease_s
            )
        return self._sender

    def handoff(self, shipments: list[Shipment]) -> None:
        """Committed messages, for the sender (called by the transaction flavours after the commit)."""
        self.sender.offer(shipments)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every message committed so far was shipped or left to the relay; False on
        timeout. Useful in scripts and tests; a web app never needs to call it."""
        return self._sender is None or self._sender.wait_idle(timeout)

    def close(self) -> None:
        """Ship what is queued (briefly), then stop the sender. Called at interpreter exit too."""
        if self._sender is not None:
            self._sender.close()
        _live_producers.discard(self)

    def learn_engine(self, engine: sa.Engine) -> None:
        """The engine the application's sessions write through, when the Producer got only `session=`."""
        if self._learned_engine is None:
            self._learned_engine = engine

    def sender_engine(self) -> sa.Engine:
        """The engine the sender reads and marks rows with (its own connections, outside the app's)."""
        if self.engine is not None:
            return self.engine
        if self._learned_engine is not None:
            return self._learned_engine
        if self.using is not None:
            from qmq.contrib.django.engine import engine_for_alias

            self._learned_engine = engine_for_alias(self.using)
            return self._learned_engine
        raise RuntimeError("this Producer has no engine yet: give engine= or send inside @qmq.transactional first")

    def database_name(self) -> str:
        """The outbox database's name, as the `qmq-producer` header gives it."""
        if self._database_name is None:
            if self.engine is None and self._learned_engine is None and self.using is not None:
                from qmq.contrib.django.engine import url_for_alias

                self._database_name = str(url_for_alias(self.using).database or "")
            else:
                self._database_name = str(self.sender_engine().url.database or "")
        return self._database_name

    def default_session(self) -> Session:
        """A Session for `@qmq.transactional` when the function is not given one: the Producer's
        `session` (called if it is a factory or Flask-SQLAlchemy's scoped session), else a new one."""
        if isinstance(self.session, Session):
            return self.session
        if isinstance(self.session, scoped_session) or callable(self.session):
            return self.session()
        if self.engine is None:
            raise RuntimeError("@qmq.transactional needs a session: give the Producer engine= or session=")
        return Session(self.engine)

    def _new_client(self) -> Client:
        client_id = f"producer-{socket.gethostname()}-{os.getpid()}"
        return Client(
            meta=self.meta,
            brokers=self.brokers,
            delay_servers=self.delay_servers,
            token=self.token,
            client_id=client_id,
        )

    def _after_fork(self) -> None:
        self._sender = None  # the parent's sender thread did not come along


def _deliver_at(delay: float | timedelta | None, deliver_at: datetime | None) -> datetime | None:
    """When a delayed message is due (UTC), None for "now". Raises ValueError for bad or too far times."""
    if delay is not None and deliver_at is not None:
        raise ValueError("give delay= or deliver_at=, not both")
    if delay is None and deliver_at is None:
        return None
    now = datetime.now(UTC)
    if delay is not None:
        seconds = delay.total_seconds() if isinstance(delay, timedelta) else float(delay)
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"delay must be a finite number of seconds >= 0, not {delay!r}")
        if seconds == 0:
            return None
        deliver_at = now + timedelta(seconds=seconds)
    assert deliver_at is not None
    if deliver_at.tzinfo is None:
        raise ValueError("deliver_at must be timezone-aware (e.g. datetime.now(UTC) + timedelta(hours=1))")
    if deliver_at - now > MAX_DELAY:
        raise ValueError(f"deliver_at {deliver_at.isoformat()} is more than {MAX_DELAY.days} days ahead")
    return deliver_at.astimezone(UTC) if deliver_at > now else None


_live_producers: weakref.WeakSet[Producer] = weakref.WeakSet()


def _close_all() -> None:
    for producer in list(_live_producers):
        producer.close()


def _forget_senders() -> None:
    for producer in list(_live_producers):
        producer._after_fork()


atexit.register(_close_all)
os.register_at_fork(after_in_child=_forget_senders)
