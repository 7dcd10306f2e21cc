"""A test app with one consumer whose handler does what each message's body says and records every
attempt, so tests can see from outside what the worker did.

Body (a JSON object, every key optional): `sleep` seconds; `hang_in` a worker name (sleep 600 s there
only); `fail_times` N (raise while attempts <= N); `always_fail`; `retry_delay` d (raise
`qmq.Retry(delay=d)` on the first attempt); `reject` reason; `spin` seconds (busy in Python, for the
time limit; on the first attempt only); `die_first` (the process SIGKILLs itself on the first
attempt: for pool processes only).

Each attempt is written to `worker_attempts` at once (its own transaction); a handling that succeeds
writes `worker_handled` through the message's session, so the row exists exactly when the worker
committed it. Neither table has a unique key: duplicates would show. The consumers do not say where
a new group starts: the worker's default (earliest) applies. (Tables: tests/support/worker.py.)

Settings (environment): QMQ_TEST_BROKERS (comma-separated) or QMQ_TEST_META, QMQ_TEST_DB, QMQ_TEST_REDIS,
QMQ_TEST_REDIS_PREFIX, QMQ_TEST_SUBJECT, QMQ_TEST_GROUP, QMQ_TEST_IDEMPOTENT ("", "sql" or "redis"),
QMQ_TEST_BROADCAST ("1"), QMQ_TEST_MAX_RETRIES, QMQ_TEST_TIME_LIMIT, QMQ_TEST_WORKER (a name to record),
QMQ_TEST_ALSO (comma-separated subjects the same handler also consumes, as the same group).
"""

from __future__ import annotations

import os
import signal
import time

import sqlalchemy as sa

import qmq

env = os.environ.get
WORKER = env("QMQ_TEST_WORKER", f"pid-{os.getpid()}")
IDEMPOTENT = {"": False, "sql": True, "redis": "redis"}[env("QMQ_TEST_IDEMPOTENT", "")]

META = env("QMQ_TEST_META") or None  # a meta server (replicated groups), else the brokers directly
app = qmq.App(
    "recorder",
    meta=META,
    brokers=None if META else env("QMQ_TEST_BROKERS", "127.0.0.1:20881").split(","),
    db=env("QMQ_TEST_DB"),
    redis=env("QMQ_TEST_REDIS"),
    redis_prefix=env("QMQ_TEST_REDIS_PREFIX", "qmq:"),
)

INSERT_ATTEMPT = sa.text(
    "INSERT INTO worker_attempts (message_id, attempts, worker, at) VALUES (:id, :attempts, :worker, clock_timestamp())"
)
INSERT_HANDLED = sa.text(
    "INSERT INTO worker_handled (message_id, attempts, worker, handled_at) "
    "VALUES (:id, :attempts, :worker, clock_timestamp())"
)


@app.consumer(
    env("QMQ_TEST_SUBJECT", "work"),
    group=env("QMQ_TEST_GROUP", "recorder"),
    broadcast=env("QMQ_TEST_BROADCAST") == "1",
    idempotent=IDEMPOTENT,
    max_retries=int(env("QMQ_TEST_MAX_RETRIES", "5")),
    retry_backoff=0.2,
    retry_jitter=False,
    time_limit=float(env("QMQ_TEST_TIME_LIMIT")) if env("QMQ_TEST_TIME_LIMIT") else None,
)
def handle(message: qmq.Message, session) -> None:
    row = {"id": message.id, "attempts": message.attempts, "worker": WORKER}
    with app.engine.begin() as conn:
        conn.execute(INSERT_ATTEMPT, row)
    body = message.body if isinstance(message.body, dict) else {}
    if body.get("sleep"):
        time.sleep(body["sleep"])
    if body.get("die_first") and message.attempts == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if body.get("hang_in") == WORKER:
        time.sleep(600)
    if body.get("spin") and message.attempts == 1:
        end = time.monotonic() + body["spin"]
        while time.monotonic() < end:
            pass
    if message.attempts <= body.get("fail_times", 0):
        raise RuntimeError(f"failing on purpose, attempt {message.attempts}")
    if body.get("always_fail"):
        raise ValueError("this message always fails")
    if body.get("retry_delay") and message.attempts == 1:
        raise qmq.Retry(delay=body["retry_delay"])
    if body.get("reject"):
        raise qmq.Reject(body["reject"])
    session.execute(INSERT_HANDLED, row)


for also in filter(None, env("QMQ_TEST_ALSO", "").split(",")):
    app.consumer(
        also,
        group=env("QMQ_TEST_GROUP", "recorder"),
        idempotent=IDEMPOTENT,
        max_retries=int(env("QMQ_TEST_MAX_RETRIES", "5")),
        retry_backoff=0.2,
        retry_jitter=False,
    )(handle)
