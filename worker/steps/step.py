"""The step protocol: steps around a handler, in the manner of Dramatiq's middleware. Each step gets
the call and the rest of the chain, and may act before, after, or instead of it.

    def audit(call: Call, call_next: Next) -> Outcome:
        started = time.monotonic()
        outcome = call_next(call)
        print(call.message.id, outcome.kind, time.monotonic() - started)
        return outcome

    app.add_step(audit)

The built-in steps, outermost first: logging and metrics (where the worker pulls and acks), then
hooks, retry, the app's own steps, the transaction, idempotency, the time limit, and the handler
(where the handler runs: the same thread, or a pool process). A step returns an `Outcome`; an
exception a step raises is a failure of the message, decided by the retry step like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from worker.message import Message
from worker.outcome import Outcome

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection
    from sqlalchemy.orm import Session

    from worker.consumer import Consumer
    from worker.database import HandlerTransaction


@dataclass(slots=True)
class Call:
    """One message on its way to its handler. `transaction` is set by the transaction step for
    consumers that use the database, with `connection` (SQLAlchemy apps) and `session` (bound to it,
    for handlers that take one); `state` is free for steps to pass things along."""

    message: Message
    consumer: Consumer
    transaction: HandlerTransaction | None = None
    connection: Connection | None = None
    session: Session | None = None
    state: dict[str, Any] = field(default_factory=dict)


Next = Callable[[Call], Outcome]
Step = Callable[[Call, Next], Outcome]


def chain(steps: Sequence[Step], endpoint: Next) -> Next:
    """`steps[0]` outermost, `endpoint` innermost, as one callable."""
    call_next = endpoint
    for step in reversed(steps):
        call_next = _bind(step, call_next)
    return call_next


def _bind(step: Step, call_next: Next) -> Next:
    def run(call: Call) -> Outcome:
        return step(call, call_next)

    return run
