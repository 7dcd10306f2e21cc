"""Deliveries a broker already holds: a delay server that fired a message and did not learn that a
broker stored it (killed while firing, or a failover to a replica that had not heard yet) fires it
again with the same id. The delay server marks its deliveries (`"once": true` on each message of a
BROKER_SEND, `ForwardedMessage`); a marked message whose id this broker already stored for the same
subject is answered as stored and not stored again, so consumers see it once.

The window is what the key index covers: the message log's retention (72 h by default), far longer
than any re-fire takes. Copies arriving in the same moment (neither in the index yet: two in one
send, or two sends read together) are stored once too: the broker knows which marked messages it is
storing, and a copy of one waits for that send's outcome (qmq/broker/sending.py). A re-fire usually
comes seconds later anyway, since a delay master that may have been replaced (fenced, or handing
over) fires nothing (delay_server/scheduler.py, `in_office`). Unmarked sends (producers, the relay)
are not looked up: the hot path pays nothing.
"""

from __future__ import annotations

from qmq.protocol.limits import ONCE_FIELD
from qmq.store.store import LogStore

__all__ = ["ONCE_FIELD", "already_stored"]


def already_stored(store: LogStore, subject: str, message_id: str) -> bool:
    """Whether a message with this id is stored already for `subject` (asked for a message marked
    `ONCE_FIELD` only). A few reads through the key index."""
    return any(record.subject == subject for record in store.find_all_by_id(message_id))
