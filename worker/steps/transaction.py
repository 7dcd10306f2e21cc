"""The transaction step: for a consumer that uses the database (it is idempotent with SQL, or its
handler takes a `session` argument), one transaction of the app's database (worker/database.py:
SQLAlchemy, or a Django `atomic` block) is opened around the rest of the chain and committed when it
returns an outcome to acknowledge; any exception rolls it back. The worker acknowledges only after
that commit, so a crash anywhere before it leaves the message to be delivered again and nothing of
its handling in the database.
"""

from __future__ import annotations

from worker.outcome import Kind, Outcome
from worker.steps.step import Call, Next


def transaction_step(call: Call, call_next: Next) -> Outcome:
    consumer = call.consumer
    if not consumer.uses_db:
        return call_next(call)
    with consumer.app.database.transaction(consumer.wants_session) as transaction:
        call.transaction, call.connection, call.session = transaction, transaction.connection, transaction.session
        try:
            outcome = call_next(call)
        finally:
            call.transaction = call.connection = call.session = None
        if outcome.kind not in (Kind.ACK, Kind.DUPLICATE):  # a step chose a retry or a dead letter: nothing stays
            transaction.rollback_only()
    return outcome
