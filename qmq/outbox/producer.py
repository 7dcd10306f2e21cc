"""`qmq.Producer`: sending a message as part of the application's database transaction.

`send` writes an outbox row in the transaction the caller is in, so the message commits or rolls back
with the business rows: the one it is given (`session=`, `connection=`), an `@qmq.transactional`
block, a Django `atomic` block, or Flask-SQLAlchemy's `db.session`. When it cannot know the
transaction it refuses (`NotInTransaction`) rather than commit the message on its own; `send_now`
is the explicit standalone send. After the commit the in-process sender ships the message at once;
the relay (`qmq relay`) ships whatever the sender could not.

Promises: `send` returns the message's id, made before the commit (the id consumers and the nightly
reconciliation see); no path delivers a message whose transaction rolled back; it raises only for a
message that could never be delivered (bad subject, tags, key, body or size), for a transaction it
cannot join, or for a database error of the insert itself; a broker that is down never makes it raise
or block.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import uuid
import weakref
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa

from qmq.client.blocking import Client
from qmq.client.messages import OutgoingMessage, check_message
from qmq.outbox import context, flavours
from qmq.outbox.errors import NotInTransaction
from qmq.outbox.flavour import OutboxTransaction
from qmq.outbox.sender import Sender
from qmq.outbox.shipping import Shipment
from qmq.protocol import bodies, envelope

INSERT_LEASE_S = 10.0  # a new row is left to its own sender this long; then any relay may ship it
MAX_DELAY = timedelta(days=730)  # the delay server's default limit: two years


class Producer:
    """Sends messages in the application's transactions; one per database.

    Say which database with one of: `engine` (a SQLAlchemy Engine), `session` (a Session factory or
    Flask-SQLAlchemy's `db.session`, used by `@qmq.transactional` when the function is not given one),
    `using` (a Django database alias); they choose the producer's flavour (qmq/outbox/flavour.py).
    `meta` (or `brokers` and `delay_servers`, lists of "host:port") says where to ship.
    `after_commit=False` leaves every message to the relay (woken by NOTIFY). `encoder` (a
    `json.JSONEncoder` subclass or a `default(obj)` callable) encodes body types JSON does not know,
    beyond datetime, Decimal and UUID (qmq/protocol/bodies.py)."""

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
        encoder: bodies.Encoder | None = None,
    ) -> None:
        self.flavour = flavours.choose(engine, session, using)
        self.encoder = bodies.encoder_class(encoder)
        self.meta = meta or os.environ.get("QMQ_META")
        self.brokers = list(brokers) if brokers else None
        self.delay_servers = list(delay_servers) if delay_servers else None
        if not self.meta and not self.brokers:
            raise ValueError("a Producer needs meta='host:port' (or $QMQ_META) or brokers=[...]")
        self.token = token if token is not None else os.environ.get("QMQ_TOKEN")
        self.after_commit = after_commit
        self.insert_lease_s = insert_lease_s
        self._sender: Sender | None = None
        self._sender_lock = threading.Lock()  # one sender, however many threads send first at once
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
        order_key: str | None = None,
        session: Any = None,
        connection: Any = None,
    ) -> str:
        """Write `body` for `subject` into the outbox of the transaction the caller is in; return the
        message id. The transaction is `session` (a SQLAlchemy Session) or `connection` (a
        Connection) when given, else the enclosing `@qmq.transactional` block, Django `atomic` block
        of the producer's alias or Flask-SQLAlchemy `db.session`; with none of them, NotInTransaction.
        Bodies: bytes, str, or anything JSON can encode (the content type is recorded). With `delay`
        (seconds or a timedelta) or `deliver_at` (an aware datetime), the message goes to the delay
        server and is delivered then, never before. With `order_key`, the messages of one subject
        and key are shipped and handled in outbox order, one at a time per consumer group
        (docs/ordering.md); an ordered message cannot be delayed."""
        if session is not None or connection is not None:
            transaction = self.flavour.given_transaction(self.handoff, session, connection)
        else:
            transaction = context.current(self) or self.flavour.caller_transaction(self.handoff)
        if transaction is None:
            raise NotInTransaction(
                f"producer.send({subject!r}, ...) is outside any transaction this Producer can join, so its "
                f"message could neither commit nor roll back with your work. {self.flavour.how_to_join()}. "
                "For a message that belongs to no transaction, call producer.send_now(...)."
            )
        values, shipment = self._prepare(subject, body, key, tags, headers, delay, deliver_at, order_key)
        self._write(transaction, values, shipment)
        return shipment.message.id

    def send_now(self, subject: str, body: Any, **options: Any) -> str:
        """Send a message that belongs to no transaction: its outbox row is written and committed on
        its own, at once, then shipped like any other (the row still guarantees delivery). Takes
        `send`'s options but `session` and `connection`. Never use it for a message about work that
        might still roll back."""
        if "session" in options or "connection" in options:
            raise TypeError("send_now() makes its own transaction: it takes no session= or connection=")
        with self.flavour.standalone(self.handoff) as alone, context.opened(self, alone):
            return self.send(subject, body, **options)

    def _prepare(
        self,
        subject: str,
        body: Any,
        key: str | None,
        tags: Sequence[str],
        headers: Mapping[str, str] | None,
        delay: float | timedelta | None,
        deliver_at: datetime | None,
        order_key: str | None = None,
    ) -> tuple[dict[str, Any], Shipment]:
        """The outbox row's values and the message, checked: raises now, in the caller, for what a
        broker would refuse, rather than in the relay, forever."""
        when = _deliver_at(delay, deliver_at)
        raw, content_type = bodies.encode(body, self.encoder)
        headers = {**(headers or {}), envelope.PRODUCER_HEADER: f"outbox:{self.flavour.database_name()}"}
        message = OutgoingMessage(
            subject,
            raw,
            key=key,
            tags=tuple(tags),
            headers=headers,
            content_type=content_type,
            deliver_at=when,
            order_key=order_key,
        )
        check_message(message)  # InvalidMessage with the broker's code for what a broker would refuse
        values = {
            "message_id": message.id,
            "subject": subject,
            "body": raw,
            "content_type": content_type,
            "headers": message.headers,
            "tags": list(message.tags) or None,
            "key": key,
            "deliver_at": when,
            "order_key": order_key,
        }
        return values, Shipment(message)

    def _write(self, transaction: OutboxTransaction, values: dict[str, Any], shipment: Shipment) -> None:
        lease = self.sender.token if self.after_commit and self.sender.has_room() else None
        transaction.insert(values, lease, self.insert_lease_s)
        if lease is None:
            transaction.notify()
        else:
            transaction.after_commit(shipment)

    # ---- after the commit --------------------------------------------------------------------------

    @property
    def sender(self) -> Sender:
        """The one after-commit sender of this producer (and process). Rows are leased to its token:
        a second sender, made by a thread racing the first, would lease rows that nobody ships."""
        sender = self._sender
        if sender is not None:
            return sender
        with self._sender_lock:
            if self._sender is None:
                self._sender = Sender(
                    self.flavour.engine, self._new_client, token=str(uuid.uuid4()), lease_s=self.insert_lease_s
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
        """Ship what is queued (briefly), stop the sender and close the connections qmq opened for it
        (a Django alias's; never the application's engine). Called at interpreter exit too."""
        if self._sender is not None:
            self._sender.close()
        self.flavour.close()
        _live_producers.discard(self)

    def _new_client(self) -> Client:
        client_id = f"producer-{socket.gethostname()}-{os.getpid()}"
        return Client(
            meta=self.meta,
            brokers=self.brokers,
            delay_servers=self.delay_servers,
            token=self.token,
            client_id=client_id,
            # The relay ships what the sender could not: the sender waits for no failover while it
            # holds its rows (and the rows committed behind them).
            delivery_timeout_s=0.0,
        )

    def _after_fork(self) -> None:
        self._sender = None  # the parent's sender thread did not come along
        self._sender_lock = threading.Lock()  # nor the thread that may have held the lock


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
