"""Waking relays: the producer's transaction NOTIFYs one PostgreSQL channel when it leaves a row for
the relay, and each relay LISTENs on it, with polling as the fallback (and SQLite's only way).

NOTIFY is sent only for rows no in-process sender will ship: PostgreSQL serialises the commits of
notifying transactions, so notifying on every transaction would cost the application throughput.
"""

from __future__ import annotations

import logging
import threading

import psycopg
import sqlalchemy as sa

log = logging.getLogger(__name__)

CHANNEL = "qmq_outbox"
NOTIFY_SQL = f"SELECT pg_notify('{CHANNEL}', '')"
RECONNECT_DELAY_S = 1.0  # between attempts to listen again after the connection broke


class Listener:
    """A thread holding a LISTEN connection to one PostgreSQL database; `wake` is set on every
    notification and whenever the connection is re-established (something may have been missed)."""

    def __init__(self, engine: sa.Engine, wake: threading.Event, stop: threading.Event) -> None:
        url = engine.url.set(drivername="postgresql")
        self._dsn = url.render_as_string(hide_password=False)
        self._wake = wake
        self._stop = stop
        self._thread = threading.Thread(target=self._run, name=f"qmq-relay-listen-{url.database}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True, connect_timeout=5) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self._wake.set()
                    while not self._stop.is_set():
                        for _ in conn.notifies(timeout=0.5):
                            self._wake.set()
            except psycopg.Error as exc:
                log.warning("LISTEN %s lost its connection (%s); polling until it is back", CHANNEL, exc)
                self._stop.wait(RECONNECT_DELAY_S)
