"""The relay (`qmq relay`): the guarantee behind the after-commit sender. It ships every committed
outbox row that nobody shipped (the app died after its commit, a broker was down, the sender's queue
was full), keeps sent rows for the audit window and then purges them.

Per database: a few shipping threads, each holding one connection, take due rows with
`FOR UPDATE SKIP LOCKED`, so any number of relays can share a database. On PostgreSQL a batch is
taken, shipped and recorded in one transaction (qmq/outbox/rows.py, `take_due`): its row locks are
the lease, cut off by the server after `lease_s`; on SQLite rows are claimed with a lease token on the
database clock, shipped, and marked under that token. They sleep until a NOTIFY, the next row's due
time or the poll interval, whichever comes first. A housekeeping thread flags rows pending too long
(logged and counted, never dropped), updates the backlog gauges and purges in small batches. A
database or broker that goes away is waited for and reconnected to; stopping finishes the batch in
hand.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa

from qmq.client.blocking import Client
from qmq.db.engine import create_engine, prepare_nothing, safe_url
from qmq.outbox import metrics, ordered_shipping, rows, shipping
from qmq.outbox.notify import Listener

log = logging.getLogger(__name__)

BATCH_ROWS = 500  # rows claimed and shipped together
LEASE_S = 60.0  # a claimed row is the relay's this long; longer than any send can take
POLL_INTERVAL_S = 1.0  # the longest a relay sleeps without looking (NOTIFY wakes it sooner)
SHIPPING_THREADS = 2  # per database
SEND_BATCH_MESSAGES = 256  # messages per BROKER_SEND request: a batch of rows goes in a few of them
KEEP_SENT_S = 7 * 86400.0  # the audit window: sent rows are kept this long for the reconciliation
PURGE_BATCH_ROWS = 5_000  # deleted per short transaction
PURGE_INTERVAL_S = 60.0
HOUSEKEEPING_INTERVAL_S = 10.0  # backlog gauges and flagging...
HOUSEKEEPING_MAX_SHARE = 0.05  # ...or longer: its passes take at most this share of the time
FLAG_AFTER_S = 600.0  # a row pending this long is flagged...
FLAG_AFTER_ATTEMPTS = 10  # ...or one that failed this many times
FLAG_LOG_MAX = 20  # flagged rows logged one by one per pass; the rest as a count
DB_RETRY_MIN_S = 0.5  # after a database error, wait this long, doubling...
DB_RETRY_MAX_S = 30.0  # ...up to this
SUMMARY_INTERVAL_S = 60.0  # a line about what was shipped, at most this often
# The main thread looks at the stop flag this often. A signal the kernel hands to another thread
# (SIGTERM goes to any thread of the process) runs its Python handler only once the main thread runs
# Python again; an untimed wait would never wake for it.
STOP_CHECK_S = 0.5


@dataclass
class RelaySettings:
    batch_rows: int = BATCH_ROWS
    lease_s: float = LEASE_S
    poll_interval_s: float = POLL_INTERVAL_S
    shipping_threads: int = SHIPPING_THREADS
    keep_sent_s: float = KEEP_SENT_S
    purge_batch_rows: int = PURGE_BATCH_ROWS
    purge_interval_s: float = PURGE_INTERVAL_S
    flag_after_s: float = FLAG_AFTER_S
    flag_after_attempts: int = FLAG_AFTER_ATTEMPTS
    # PostgreSQL: wake on NOTIFY. Off behind PgBouncer in transaction mode, where LISTEN (session
    # state) cannot work: the relay then polls every poll_interval_s.
    listen: bool = True


@dataclass
class SweepReport:
    """What one sweep of one database did (`qmq relay --once`, the Celery task)."""

    database: str
    shipped: int = 0
    failed: int = 0
    purged: int = 0
    flagged: int = 0
    pending: int = 0
    errors: list[str] = field(default_factory=list)


def housekeeping_pause_s(took_s: float) -> float:
    """The pause after a housekeeping pass that took `took_s`: HOUSEKEEPING_INTERVAL_S, or longer when
    the pass was slow, so that its scans of the pending rows (slow with a large backlog, as after a
    broker outage: the gauges and the flagging read every pending row) take at most
    HOUSEKEEPING_MAX_SHARE of the time, and leave the database to the shipping."""
    return max(HOUSEKEEPING_INTERVAL_S, took_s * (1.0 / HOUSEKEEPING_MAX_SHARE - 1.0))


class DatabaseRelay:
    """Relays one outbox database with a client of its own."""

    def __init__(
        self, url: str, new_client: Callable[[], Client], settings: RelaySettings, stop: threading.Event
    ) -> None:
        self.engine = create_engine(url)
        prepare_nothing(self.engine)  # a transaction-mode PgBouncer keeps no named statement for us
        self.name = safe_url(self.engine)
        self.new_client = new_client
        self.settings = settings
        self.stop = stop
        self.wake = threading.Event()
        self._threads: list[threading.Thread] = []
        self._listener: Listener | None = None
        self._shipped_since_summary = 0
        self._summary_at = time.monotonic()
        self._lock = threading.Lock()

    # ---- running as a service ----------------------------------------------------------------------

    def start(self) -> None:
        if self.engine.dialect.name == "postgresql" and self.settings.listen:
            self._listener = Listener(self.engine, self.wake, self.stop)
            self._listener.start()
        for i in range(self.settings.shipping_threads):
            self._spawn(self._ship_loop, f"qmq-relay-ship-{i}")
        self._spawn(self._housekeeping_loop, "qmq-relay-housekeeping")
        log.info(
            "relaying %s: %d shipping threads, %s",
            self.name,
            self.settings.shipping_threads,
            "LISTEN/NOTIFY and polling" if self._listener else "polling",
        )

    def join(self, timeout: float) -> list[str]:
        """Wait up to `timeout` for the threads to end; the names of those still running."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            thread.join(max(deadline - time.monotonic(), 0))
        if self._listener is not None:
            self._listener.join(max(deadline - time.monotonic(), 0))
        self.engine.dispose()
        return [thread.name for thread in self._threads if thread.is_alive()]

    def _spawn(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _ship_loop(self) -> None:
        client = self._client()
        token = str(uuid.uuid4())
        failures = 0
        conn: sa.Connection | None = None  # held across batches: no checkout and no ping per batch
        ordered_at = 0.0
        try:
            while not self.stop.is_set():
                try:
                    conn = conn or self.engine.connect()
                    report = self.ship_batch(client, token, conn)
                    ordered = None
                    # While full batches come, ordered keys get a pass every poll interval rather than
                    # a query per batch; once the backlog is drained, on every round.
                    full = report is not None and len(report.sent) + len(report.failed) >= self.settings.batch_rows
                    if not full or time.monotonic() - ordered_at >= self.settings.poll_interval_s:
                        ordered_at = time.monotonic()
                        ordered = self.ship_ordered(client, conn)
                    failures = 0
                except sa.exc.SQLAlchemyError as exc:
                    if conn is not None:
                        with contextlib.suppress(sa.exc.SQLAlchemyError):
                            conn.invalidate()
                            conn.close()
                    conn = None
                    failures += 1
                    self._database_error(exc, failures)
                    continue
                if report is None and (ordered is None or not ordered.keys):
                    self._sleep_until_due(conn)
        finally:
            if conn is not None:
                with contextlib.suppress(sa.exc.SQLAlchemyError):
                    conn.close()
            client.close()

    def _client(self) -> Client:
        """A shipping client: big batches, and no waiting for a broker to come back while holding
        rows (a failed row is given back with a backoff and shipped again later)."""
        client = self.new_client()
        client.batch_size = max(client.batch_size, SEND_BATCH_MESSAGES)
        client.delivery_timeout_s = 0.0
        return client

    def _sleep_until_due(self, conn: sa.Connection) -> None:
        timeout = self.settings.poll_interval_s
        try:
            with conn.begin():
                due_in = rows.seconds_until_due(conn)
        except sa.exc.SQLAlchemyError:
            due_in = None
        if due_in is not None:
            timeout = min(timeout, max(due_in, 0.0) + 0.01)
        if self.wake.wait(timeout):
            self.wake.clear()

    def _housekeeping_loop(self) -> None:
        next_purge = time.monotonic()
        failures = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                self.housekeeping()
                took_s = time.monotonic() - started
                if time.monotonic() >= next_purge:
                    self.purge()
                    next_purge = time.monotonic() + self.settings.purge_interval_s
                failures = 0
            except sa.exc.SQLAlchemyError as exc:
                failures += 1
                self._database_error(exc, failures)
                continue
            self.stop.wait(housekeeping_pause_s(took_s))

    def _database_error(self, exc: Exception, failures: int) -> None:
        metrics.DB_ERRORS.labels(self.name).inc()
        delay = min(DB_RETRY_MIN_S * 2 ** (failures - 1), DB_RETRY_MAX_S)
        if failures == 1 or delay == DB_RETRY_MAX_S:
            log.warning("database %s: %s; retrying in %.1f s", self.name, _first_line(exc), delay)
        self.stop.wait(delay)

    # ---- the work, one step at a time --------------------------------------------------------------

    def ship_batch(self, client: Client, token: str, conn: sa.Connection) -> shipping.ShipReport | None:
        """Take one batch of due rows, ship it and record the outcome on `conn` (not in a transaction);
        None when nothing was due."""
        started = time.perf_counter()
        if conn.dialect.name == "postgresql":
            with conn.begin():  # the rows are ours until the commit: taken, shipped, failures given back
                claimed = rows.take_due(conn, self.settings.batch_rows, self.settings.lease_s)
                if not claimed:
                    return None
                report = shipping.ship_taken(conn, client, [shipping.shipment(r) for r in claimed])
        else:
            with conn.begin():
                claimed = rows.claim_due(conn, token, self.settings.batch_rows, self.settings.lease_s)
            if not claimed:
                return None
            report = shipping.ship(conn, client, [shipping.shipment(r) for r in claimed], token)
        metrics.LEASE_LOST.labels(self.name).inc(report.lease_lost)
        self._record(
            started, report.sent, report.failed, f"of {len(claimed)} rows not shipped, retrying after a backoff"
        )
        self._summarise(len(report.sent))
        return report

    def _record(self, started: float, sent: Sequence[Any], failed: Sequence[Any], failure: str) -> None:
        """Metrics of one batch (or ordered pass), and one warning naming the first failure."""
        metrics.BATCH_SECONDS.labels(self.name).observe(time.perf_counter() - started)
        metrics.SHIPPED.labels(self.name).inc(len(sent))
        if failed:
            metrics.SEND_FAILED.labels(self.name).inc(len(failed))
            log.warning("database %s: %d %s: %s", self.name, len(failed), failure, failed[0].error)

    def ship_ordered(self, client: Client, conn: sa.Connection) -> ordered_shipping.OrderedReport | None:
        """One pass over ordered rows: the keys whose oldest row is ready, each shipped in order under
        its lock (qmq/outbox/ordered_shipping.py); None when no key was ready."""
        started = time.perf_counter()
        report = ordered_shipping.ship_ready_keys(conn, client, self.settings.lease_s)
        if report is None or not report.keys:
            return report
        self._record(started, report.sent, report.failed, "ordered rows not shipped, their keys wait for the backoff")
        self._summarise(len(report.sent))
        return report

    def housekeeping(self) -> int:
        """Flag rows pending too long and update the backlog gauges; the number flagged now."""
        after_s, attempts = self.settings.flag_after_s, self.settings.flag_after_attempts
        with self.engine.begin() as conn:
            backlog = rows.backlog(conn)
            flagged = rows.flag_overdue(conn, after_s, attempts) if backlog.may_need_flagging(after_s, attempts) else []
        for row in flagged[:FLAG_LOG_MAX]:
            log.error(
                "database %s: message %s (%s) is still not shipped after %d attempts: %s",
                self.name,
                row.message_id,
                row.subject,
                row.attempts,
                row.last_error or "not tried yet",
            )
        if len(flagged) > FLAG_LOG_MAX:
            log.error("database %s: %d more rows flagged as pending too long", self.name, len(flagged) - FLAG_LOG_MAX)
        metrics.FLAGGED.labels(self.name).inc(len(flagged))
        metrics.PENDING.labels(self.name).set(backlog.pending)
        metrics.OLDEST_PENDING.labels(self.name).set(backlog.oldest_age_s)
        metrics.FLAGGED_PENDING.labels(self.name).set(backlog.flagged + len(flagged))
        return len(flagged)

    def purge(self) -> int:
        """Delete rows sent before the audit window, one short transaction per batch; the number deleted."""
        total = 0
        while not self.stop.is_set():
            with self.engine.begin() as conn:
                deleted = rows.purge_sent(conn, self.settings.keep_sent_s, self.settings.purge_batch_rows)
            total += deleted
            if deleted < self.settings.purge_batch_rows:
                break
        if total:
            metrics.PURGED.labels(self.name).inc(total)
            log.info(
                "database %s: purged %d rows sent more than %.0f s ago", self.name, total, self.settings.keep_sent_s
            )
        return total

    def sweep(self) -> SweepReport:
        """Ship everything due now, flag, purge: one pass, for `--once` and the Celery task."""
        report = SweepReport(self.name)
        client = self._client()
        token = str(uuid.uuid4())
        try:
            with self.engine.connect() as conn:
                while not self.stop.is_set():
                    batch = self.ship_batch(client, token, conn)
                    if batch is None:
                        break
                    report.shipped += len(batch.sent)
                    report.failed += len(batch.failed)
                    if batch.failed:
                        break  # the rest waits for the backoff
                while not self.stop.is_set():
                    ordered = self.ship_ordered(client, conn)
                    if ordered is None or not ordered.keys:
                        break
                    report.shipped += len(ordered.sent)
                    report.failed += len(ordered.failed)
            report.flagged = self.housekeeping()
            report.purged = self.purge()
            with self.engine.connect() as conn:
                report.pending = rows.backlog(conn).pending
        except sa.exc.SQLAlchemyError as exc:
            metrics.DB_ERRORS.labels(self.name).inc()
            report.errors.append(_first_line(exc))
        finally:
            client.close()
        return report

    def _summarise(self, shipped: int) -> None:
        with self._lock:
            self._shipped_since_summary += shipped
            now = time.monotonic()
            if now - self._summary_at < SUMMARY_INTERVAL_S:
                return
            count, self._shipped_since_summary, self._summary_at = self._shipped_since_summary, 0, now
        log.info("database %s: shipped %d rows in the last %.0f s", self.name, count, SUMMARY_INTERVAL_S)


class Relay:
    """Relays every outbox database given, until `stop` is set."""

    def __init__(
        self, urls: Sequence[str], new_client: Callable[[], Client], settings: RelaySettings | None = None
    ) -> None:
        if not urls:
            raise ValueError("the relay needs at least one outbox database URL")
        self.stop = threading.Event()
        self.settings = settings or RelaySettings()
        self.databases = [DatabaseRelay(url, new_client, self.settings, self.stop) for url in urls]

    def run(self) -> list[str]:
        """Serve until `stop` is set, then finish the batches in hand and return: the names of the
        threads whose batch did not finish within the lease (their sends wait for a broker)."""
        for database in self.databases:
            database.start()
        while not self.stop.wait(STOP_CHECK_S):
            pass
        log.info("relay stopping: finishing the batches in hand")
        return [name for database in self.databases for name in database.join(timeout=self.settings.lease_s)]

    def sweep(self) -> list[SweepReport]:
        reports = [database.sweep() for database in self.databases]
        for database in self.databases:
            database.engine.dispose()
        return reports


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
