"""The after-commit sender: the fast path from a committed outbox row to a broker, in the application's
own process, on one background thread.

The producer inserts each row leased to this sender's token; after the commit it hands the messages
over with `offer`, which never blocks and never raises. The sender ships only rows it finds (a
message whose transaction or savepoint rolled back has no row and is never shipped), in batches of
whatever was handed over while it shipped the one before; when busy (above LINGER_ABOVE_PER_S) it
also waits up to LINGER_S for more, otherwise a message goes at once. On PostgreSQL one transaction
per batch takes the rows (marks them sent under its row locks), ships them, gives failures back and
commits (qmq/outbox/rows.py, `take_leased`); elsewhere it reads which rows exist, ships them and
marks them under its lease. Anything it cannot ship (queue full, broker
down, database gone, process killed) is left to the relay: the row's lease runs out, or the sender
gives it back at once with its error and a backoff.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from prometheus_client import Counter

from qmq.client.blocking import Client
from qmq.outbox import ordered_shipping, rows, shipping
from qmq.outbox.shipping import Shipment

log = logging.getLogger(__name__)

QUEUE_MAX_MESSAGES = 10_000  # handed over but not yet shipped; beyond it, rows wait for the relay
BATCH_MAX_MESSAGES = 256  # shipped together: one read, one send call, one mark
# Linger when busy: above LINGER_ABOVE_PER_S messages/s a batch waits up to LINGER_S for more to ship
# with it (fewer statements and sends per message: the application's throughput); below it a message
# goes at once (its latency).
LINGER_S = 0.002
LINGER_ABOVE_PER_S = 1000.0
RATE_WINDOW_S = 0.5
CLOSE_TIMEOUT_S = 5.0  # close() waits this long for the queue to drain
ERROR_LOG_INTERVAL_S = 10.0  # repeated failures are logged at most this often

SENT = Counter("qmq_producer_sent", "Messages shipped by the after-commit sender")
LEFT_FOR_RELAY = Counter("qmq_producer_left_for_relay", "Committed messages the sender left to the relay", ["reason"])


class Sender:
    """Ships committed messages of one database from a background thread (started on first offer)."""

    def __init__(
        self,
        engine: Callable[[], sa.Engine],
        client: Callable[[], Client],
        token: str,
        *,
        lease_s: float,
        queue_max: int = QUEUE_MAX_MESSAGES,
        batch_max: int = BATCH_MAX_MESSAGES,
    ) -> None:
        self._engine_factory = engine
        self._client_factory = client
        self.token = token
        self.lease_s = lease_s
        # Rows are born leased for lease_s; one not shipping within half of it is left to the relay, so
        # that the lease outlives the send (a send outliving it could be shipped twice).
        self.max_queued_s = lease_s / 2
        self.batch_max = batch_max
        self._queue: queue.Queue[Shipment | None] = queue.Queue(maxsize=queue_max)
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False
        self._busy = 0  # messages taken from the queue and not yet done
        self._idle = threading.Condition()
        self._last_error_log = 0.0
        self._rate = 0.0  # messages/s handed over, measured over the last RATE_WINDOW_S
        self._rate_since = time.monotonic()
        self._rate_count = 0

    def has_room(self) -> bool:
        """Whether the sender is likely to take more messages (a hint: `offer` decides)."""
        return not self._closed and not self._queue.full()

    def offer(self, shipments: Sequence[Shipment]) -> int:
        """Queue committed messages for shipping; never blocks, never raises. Returns how many were
        taken; the rest wait for the relay."""
        if self._closed:
            LEFT_FOR_RELAY.labels("closed").inc(len(shipments))
            return 0
        self._ensure_started()
        taken = 0
        now = time.monotonic()
        for item in shipments:
            item.queued_at = now
            try:
                self._queue.put_nowait(item)
            except queue.Full:
                LEFT_FOR_RELAY.labels("queue_full").inc(len(shipments) - taken)
                self._log_error(
                    "the after-commit sender's queue is full; %d messages wait for the relay", len(shipments) - taken
                )
                break
            taken += 1
        return taken

    def wait_idle(self, timeout: float) -> bool:
        """Wait until everything offered so far was shipped or given up; False on timeout."""
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._queue.unfinished_tasks or self._busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._idle.wait(min(remaining, 0.05))
        return True

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Ship what is queued (waiting up to `timeout`), then stop. What is left waits for the relay."""
        if self._closed:
            return
        self._closed = True
        thread = self._thread
        if thread is not None:
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=timeout)
            thread.join(timeout)

    def _ensure_started(self) -> None:
        if self._thread is not None:
            return
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="qmq-outbox-sender", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        client: Client | None = None
        conn: sa.Connection | None = None  # one connection held across batches: no checkout, no ping each time
        while True:
            batch, stop = self._take_batch()
            if batch:
                try:
                    client = client or self._client_factory()
                    conn = conn or self._connect()
                    self._ship(conn, client, batch)
                except Exception as exc:  # the database went away: the rows' leases run out, the relay ships
                    LEFT_FOR_RELAY.labels("error").inc(len(batch))
                    self._log_error("after-commit send of %d messages failed, left for the relay: %s", len(batch), exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            conn.invalidate()  # not back to the application's pool in an unknown state
                            conn.close()
                    conn = None
                finally:
                    self._done(len(batch))
            if stop:
                break
        if conn is not None:
            conn.close()
        if client is not None:
            client.close()

    def _take_batch(self) -> tuple[list[Shipment], bool]:
        first = self._queue.get()
        batch: list[Shipment] = []
        stop = first is None
        if first is not None:
            batch.append(first)
        now = time.monotonic()
        if now - self._rate_since >= RATE_WINDOW_S:
            self._rate = self._rate_count / (now - self._rate_since)
            self._rate_since, self._rate_count = now, 0
        linger_until = now + (LINGER_S if self._rate >= LINGER_ABOVE_PER_S else 0.0)
        while not stop and len(batch) < self.batch_max:
            try:
                item = self._queue.get(timeout=max(linger_until - time.monotonic(), 0.0))
            except queue.Empty:
                break
            if item is None:
                stop = True
            else:
                batch.append(item)
        self._rate_count += len(batch)
        with self._idle:
            self._busy += len(batch)
            for _ in range(len(batch) + (1 if stop else 0)):
                self._queue.task_done()
        return batch, stop

    def _connect(self) -> sa.Connection:
        """The sender's connection, held across batches (no checkout, no ping each time). It sets
        nothing on the session (each shipping transaction sets its own, qmq/outbox/rows.py), so it
        goes back to the application's pool, or to PgBouncer's, as it came."""
        return self._engine_factory().connect()

    def _done(self, count: int) -> None:
        with self._idle:
            self._busy -= count
            self._idle.notify_all()

    def _ship(self, conn: sa.Connection, client: Client, batch: list[Shipment]) -> None:
        oldest = time.monotonic() - self.max_queued_s
        late = [s for s in batch if s.queued_at < oldest]
        if late:
            LEFT_FOR_RELAY.labels("late").inc(len(late))
            self._log_error("%d messages waited too long for the after-commit sender; left for the relay", len(late))
            batch = [s for s in batch if s.queued_at >= oldest]
        ordered = [s for s in batch if s.message.order_key is not None]
        if ordered:
            batch = [s for s in batch if s.message.order_key is None]
            self._ship_ordered(conn, client, ordered)
        if not batch:
            return
        ids = [s.message.id for s in batch]
        if conn.dialect.name == "postgresql":
            with conn.begin():  # the rows are ours until the commit: taken, shipped, failures given back
                taken = rows.take_leased(conn, ids, self.token, self.lease_s)
                confirmed = [s for s in batch if s.message.id in taken]
                if not confirmed:
                    return
                report = shipping.ship_taken(conn, client, confirmed)
        else:
            with conn.begin():
                existing = rows.still_leased(conn, ids, self.token)
            confirmed = [s for s in batch if s.message.id in existing]
            if not confirmed:
                return
            report = shipping.ship(conn, client, confirmed, self.token)
        self._count(report.sent, report.failed, "messages")

    def _ship_ordered(self, conn: sa.Connection, client: Client, batch: list[Shipment]) -> None:
        """Ordered messages: shipped under their keys' locks when no earlier row of the key is
        pending, else given back to the relay (qmq/outbox/ordered_shipping.py)."""
        report = ordered_shipping.ship_offered(conn, client, batch, self.token, self.lease_s)
        if report.given_back:
            LEFT_FOR_RELAY.labels("ordered_behind").inc(len(report.given_back))
        self._count(report.sent, report.failed, "ordered messages")

    def _count(self, sent: Sequence[Any], failed: Sequence[Any], what: str) -> None:
        """Metrics of one shipment, and the error naming the first failure (left for the relay)."""
        SENT.inc(len(sent))
        if failed:
            LEFT_FOR_RELAY.labels("send_failed").inc(len(failed))
            self._log_error(
                f"%d {what} could not be sent now and are left for the relay: %s", len(failed), failed[0].error
            )

    def _log_error(self, message: str, *args: object) -> None:
        now = time.monotonic()
        if now - self._last_error_log >= ERROR_LOG_INTERVAL_S:
            self._last_error_log = now
            log.warning(message, *args)
