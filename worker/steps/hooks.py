"""The hooks step: fires the message hooks (worker/hooks.py) around the retry step, so they see the
final outcome of each delivery."""

from __future__ import annotations

from worker.outcome import Kind, Outcome
from worker.steps.step import Call, Next


def hooks_step(call: Call, call_next: Next) -> Outcome:
    """Fires the message hooks around the retry step, so they see the final outcome."""
    hooks = call.consumer.app.hooks
    hooks.fire("before_message", call.message)
    outcome = call_next(call)
    if outcome.kind is Kind.RETRY:
        hooks.fire("on_retry", call.message, outcome)
    elif outcome.kind is Kind.DEAD:
        hooks.fire("on_failure", call.message, outcome)
    hooks.fire("after_message", call.message, outcome)
    return outcome
