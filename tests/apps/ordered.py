"""A test app with one ordered consumer (docs/ordering.md) that records every handler call and every
committed handling, so tests can check a key's order from outside.

Body: {"key": order key, "seq": the message's place in its key (from the producer's row lock),
"poison": true (raises until the key is in `ordered_fixed`: an operator fixed the cause),
"sleep": seconds}. Each call is written to `ordered_attempts` at once
(its own transaction); a handling that succeeds writes `ordered_handled` through the message's session,
with the idempotency record, so that table holds exactly the first committed handling of each
message, in commit order per key (`id`). Tables: tests/support/ordering.py.

Settings (environment): QMQ_TEST_META, QMQ_TEST_DB, QMQ_TEST_SUBJECT, QMQ_TEST_GROUP, QMQ_TEST_WORKER
(a name to record), QMQ_TEST_MAX_RETRIES, QMQ_TEST_ON_POISON ("dead-letter" or "stop").
"""

from __future__ import annotations

import os
import time

import sqlalchemy as sa

import qmq

env = os.environ.get
WORKER = env("QMQ_TEST_WORKER", f"pid-{os.getpid()}")

app = qmq.App("ordered", meta=env("QMQ_TEST_META"), db=env("QMQ_TEST_DB"))

INSERT_ATTEMPT = sa.text(
    "INSERT INTO ordered_attempts (message_id, order_key, seq, attempt, worker, at) "
    "VALUES (:id, :key, :seq, :attempt, :worker, clock_timestamp())"
)
FIXED = sa.text("SELECT 1 FROM ordered_fixed WHERE order_key = :key")
INSERT_HANDLED = sa.text(
    "INSERT INTO ordered_handled (message_id, order_key, seq, worker, at) "
    "VALUES (:id, :key, :seq, :worker, clock_timestamp())"
)


@app.consumer(
    env("QMQ_TEST_SUBJECT", "orders"),
    group=env("QMQ_TEST_GROUP", "ledger"),
    ordered=True,
    idempotent=True,
    max_retries=int(env("QMQ_TEST_MAX_RETRIES", "3")),
    retry_backoff=0.1,
    retry_jitter=False,
    on_poison=env("QMQ_TEST_ON_POISON", "dead-letter"),
)
def handle(message: qmq.Message, session) -> None:
    body = message.body
    row = {
        "id": message.id,
        "key": message.order_key,
        "seq": body["seq"],
        "attempt": message.attempts,
        "worker": WORKER,
    }
    with app.engine.begin() as conn:
        conn.execute(INSERT_ATTEMPT, row)
    if body.get("sleep"):
        time.sleep(body["sleep"])
    if body.get("poison") and not session.execute(FIXED, {"key": message.order_key}).first():
        raise RuntimeError(f"poison message {body['key']}/{body['seq']}")
    session.execute(INSERT_HANDLED, row)
