"""How one delivery ended, as the steps around a handler decide it and the runner carries it out.

`ACK` and `DUPLICATE` are acknowledged; `RETRY` is nacked with `delay_s` (the broker delivers it again
with attempts + 1); `DEAD` is nacked as dead, with `reason` kept beside the dead letter
(`rejected` when the handler asked for it with `qmq.Reject`). `error` is the
exception, in the process that ran the handler only (it is dropped before crossing to another).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class Kind(StrEnum):
    ACK = "ack"
    DUPLICATE = "duplicate"  # the idempotency record was there: the handler was skipped
    RETRY = "retry"
    DEAD = "dead"


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: Kind
    delay_s: float = 0.0
    reason: str = ""
    error: BaseException | None = None
    rejected: bool = False  # a deliberate dead letter (`qmq.Reject`), not a failure

    def portable(self) -> Outcome:
        """This outcome without the exception, for sending to another process."""
        return replace(self, error=None) if self.error is not None else self


ACKED = Outcome(Kind.ACK)
DUPLICATE = Outcome(Kind.DUPLICATE)
