"""`qmq.testing`: an application's consumers run in-process when its transaction commits, for its own
unit tests without brokers or workers (Celery's `task_always_eager`, Django's test client).

    import qmq.testing

    def test_an_order_gets_its_invoice(db):
        with qmq.testing.eager(producer, billing.app) as run:
            place_order(order_id=7)            # committed: billing's handler has run when it returns
        assert [m.body for m in run.handled("order.created")] == [{"id": 7}]

The same transaction rules as in production: `send` outside a transaction raises NotInTransaction;
a message whose transaction (or savepoint) rolled back is never delivered; a committed one is
delivered after the commit, to every consumer of its subject (tags filtered) in every app given,
through the consumers' steps (retry, transaction, idempotency, time limit). What differs: nothing
waits (a retry runs again at once, as Celery's eager retries do), and delayed messages are held
until `run.deliver_delayed()`. A message that ends dead-lettered makes the `with` block raise
HandlerFailed at its end (unless `propagate=False`); look at `run.dead` instead.

The database is real (SQLite in a temporary directory is enough): the outbox row is written, read
back after the commit and marked sent, as the after-commit sender does. `create_tables` makes qmq's
tables in a test database. Django: the handoff happens in `transaction.on_commit`, so use a
TransactionTestCase (pytest-django: `django_db(transaction=True)`).
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import sqlalchemy as sa

from qmq.db.metadata import metadata
from qmq.outbox import rows
from qmq.outbox.producer import Producer
from qmq.outbox.schema import outbox
from qmq.outbox.shipping import Shipment
from qmq.protocol.envelope import decode_body
from worker.app import App
from worker.consumer import Consumer
from worker.message import Message
from worker.outcome import Kind, Outcome
from worker.pipeline import inner_chain, outer_chain
from worker.schema import consumed
from worker.steps.step import Call, Next

MAX_ATTEMPTS = 1000  # a consumer retrying for ever (max_retries=None) is cut short here


class HandlerFailed(AssertionError):
    """A message was dead-lettered by a consumer during an `eager` block."""


@dataclass(frozen=True)
class Handled:
    """One delivery to one consumer, and how it ended (after the retries it made)."""

    consumer: str  # "subject/group"
    message: Message
    outcome: Outcome


@dataclass
class EagerRun:
    """What the consumers did during an `eager` block."""

    apps: Sequence[App]
    deliveries: list[Handled] = field(default_factory=list)
    delayed: list[Shipment] = field(default_factory=list)  # committed, due later: `deliver_delayed()`
    _queue: list[Shipment] = field(default_factory=list)
    _draining: bool = False
    _chains: dict[int, Next] = field(default_factory=dict)

    def handled(self, subject: str | None = None) -> list[Message]:
        """The messages consumers acknowledged (handled, or skipped as duplicates), in order."""
        return [
            d.message
            for d in self.deliveries
            if d.outcome.kind in (Kind.ACK, Kind.DUPLICATE) and subject in (None, d.message.subject)
        ]

    @property
    def dead(self) -> list[Handled]:
        return [d for d in self.deliveries if d.outcome.kind is Kind.DEAD]

    def deliver_delayed(self) -> None:
        """Deliver the delayed messages now, as if their time had come."""
        due, self.delayed = self.delayed, []
        for shipment in due:
            self._deliver(shipment)

    def check(self) -> None:
        """Raise HandlerFailed if a message was dead-lettered."""
        if self.dead:
            first = self.dead[0]
            raise HandlerFailed(
                f"{len(self.dead)} message(s) dead-lettered; the first, {first.message.id} to {first.consumer}: "
                f"{first.outcome.reason}"
            ) from first.outcome.error

    # ---- after a commit ----------------------------------------------------------------------------

    def offer(self, shipments: list[Shipment]) -> None:
        """Committed messages, delivered now; those handed over while consumers run (a handler that
        sends) wait their turn, in order."""
        self._queue.extend(shipments)
        if self._draining:
            return
        self._draining = True
        try:
            while self._queue:
                shipment = self._queue.pop(0)
                due = shipment.message.deliver_at
                if due is not None and due > time.time() * 1000:
                    self.delayed.append(shipment)
                else:
                    self._deliver(shipment)
        finally:
            self._draining = False

    def _deliver(self, shipment: Shipment) -> None:
        sent = shipment.message
        for app in self.apps:
            for consumer in app.consumers:
                if consumer.subject == sent.subject and _tags_match(consumer, tuple(sent.tags)):
                    self._run(consumer, shipment)

    def _run(self, consumer: Consumer, shipment: Shipment) -> None:
        chain = self._chains.get(id(consumer))
        if chain is None:
            chain = self._chains[id(consumer)] = outer_chain([], inner_chain(consumer))
        attempts = 1
        while True:
            message = _message(shipment, consumer.group, attempts)
            outcome = chain(Call(message, consumer))
            if outcome.kind is not Kind.RETRY or attempts >= MAX_ATTEMPTS:
                break
            attempts += 1  # no waiting: the retry runs at once
        self.deliveries.append(Handled(consumer.name, message, outcome))


class EagerSender:
    """Stands in for a producer's after-commit sender: reads back which committed rows exist (a
    rolled-back transaction's or savepoint's do not), marks them sent, and hands them to the run."""

    def __init__(self, producer: Producer, run: EagerRun) -> None:
        self.producer = producer
        self.run = run
        self.token = str(uuid.uuid4())

    def has_room(self) -> bool:
        return True

    def offer(self, shipments: list[Shipment]) -> int:
        ids = [s.message.id for s in shipments]
        with self.producer.flavour.engine().connect() as conn, conn.begin():
            there = rows.still_leased(conn, ids, self.token)
            rows.mark_sent(conn, there, self.token)
        self.run.offer([s for s in shipments if s.message.id in there])
        return len(shipments)

    def wait_idle(self, timeout: float) -> bool:
        return True

    def close(self) -> None:
        pass


@contextlib.contextmanager
def eager(producer: Producer, *apps: App, propagate: bool = True) -> Iterator[EagerRun]:
    """Within the block, messages `producer` commits are delivered in-process to the consumers of
    `apps`, right after the commit. Raises HandlerFailed at the end of the block if a message was
    dead-lettered (unless `propagate=False`)."""
    run = EagerRun(apps)
    saved = producer._sender, producer.after_commit
    producer._sender, producer.after_commit = EagerSender(producer, run), True  # type: ignore[assignment]
    try:
        yield run
    finally:
        producer._sender, producer.after_commit = saved
    if propagate:
        run.check()


def create_tables(engine: sa.Engine) -> None:
    """qmq's tables for a producer and its consumers (`qmq_outbox`, `qmq_consumed`) in a test database,
    where none exist yet (in production: `qmq db upgrade` or `manage.py migrate`)."""
    metadata.create_all(engine, tables=[outbox, consumed])


def _tags_match(consumer: Consumer, tags: tuple[str, ...]) -> bool:
    if not consumer.tags:
        return True
    if consumer.match_all:
        return set(consumer.tags) <= set(tags)
    return bool(set(consumer.tags) & set(tags))


def _message(shipment: Shipment, group: str, attempts: int) -> Message:
    sent = shipment.message
    content_type = sent.content_type or ""
    return Message(
        sent.id,
        sent.subject,
        group,
        decode_body(sent.body, content_type),
        content_type,
        tuple(sent.tags),
        sent.key,
        dict(sent.headers or {}),
        attempts,
        datetime.fromtimestamp(sent.created_at / 1000, UTC),
        datetime.now(UTC),
    )
