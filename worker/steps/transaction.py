"""The transaction step: for a consumer that uses the database (it is idempotent with SQL, or its
handler takes a `session` argument), one transaction on the app's engine is opened around the rest
of the chain and committed when it returns an outcome to acknowledge; any exception rolls it back.
The worker acknowledges only after that commit, so a crash anywhere before it leaves the message to
be delivered again and nothing of its handling in the database.

The handler's `Session` is bound to that transaction's connection (SQLAlchemy's "join an external
transaction" recipe): its writes are flushed and committed with the idempotency record. It is made
only for handlers that ask for it; a handler must not commit it itself.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from worker.outcome import Kind, Outcome
from worker.steps.step import Call, Next


def transaction_step(call: Call, call_next: Next) -> Outcome:
    consumer = call.consumer
    if not consumer.uses_db:
        return call_next(call)
    with consumer.app.engine.connect() as connection:
        transaction = connection.begin()
        call.connection = connection
        session = call.session = Session(bind=connection, expire_on_commit=False) if consumer.wants_session else None
        try:
            outcome = call_next(call)
            if session is not None:
                session.flush()
        except BaseException:
            transaction.rollback()
            raise
        finally:
            call.connection = call.session = None
            if session is not None:
                session.close()
        if outcome.kind in (Kind.ACK, Kind.DUPLICATE):
            transaction.commit()
        else:  # a step chose a retry or a dead letter without raising: nothing of this attempt stays
            transaction.rollback()
        return outcome
