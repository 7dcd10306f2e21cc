"""qmq for Celery users: `qmq.relay_sweep`, a task that runs one relay sweep (ship what is due, flag
rows pending too long, purge sent rows past the audit window) and returns what it did; put it on
Celery beat instead of (or beside) a long-running `qmq relay`:

    import qmq.contrib.celery  # registers the task with your Celery app
    app.conf.beat_schedule = {"qmq-relay": {
        "task": "qmq.relay_sweep", "schedule": 10.0,
        "kwargs": {"db": "postgresql://app@db/shop", "meta": "meta.internal:20880"}}}

Settings not given come from $QMQ_DB_URL and $QMQ_META. Sweeps may overlap (two beats, a slow
sweep): rows are leased, so none is shipped twice.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from celery import shared_task

from qmq.client.blocking import Client
from qmq.db.url import DB_URL_ENV, normalize_url
from qmq.outbox.relay import KEEP_SENT_S, Relay, RelaySettings

DAY_S = 86400.0


@shared_task(name="qmq.relay_sweep")
def relay_sweep(
    db: str | Sequence[str] | None = None,
    meta: str | None = None,
    brokers: Sequence[str] | None = None,
    delay_servers: Sequence[str] | None = None,
    keep_sent_days: float = KEEP_SENT_S / DAY_S,
    batch_rows: int = 500,
    token: str | None = None,
) -> list[dict[str, Any]]:
    """One sweep of each outbox database; a report per database (shipped, failed, purged, flagged,
    pending, errors)."""
    urls = [db] if isinstance(db, str) else list(db or os.environ.get(DB_URL_ENV, "").split())
    if not urls:
        raise ValueError(f"qmq.relay_sweep needs db= (an outbox database URL) or ${DB_URL_ENV}")
    settings = RelaySettings(batch_rows=batch_rows, keep_sent_s=keep_sent_days * DAY_S)
    relay = Relay(
        [normalize_url(u) for u in urls],
        lambda: Client(meta=meta, brokers=brokers, delay_servers=delay_servers, token=token, client_id="relay-celery"),
        settings,
    )
    return [report.__dict__ for report in relay.sweep()]
