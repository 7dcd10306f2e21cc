"""Deliveries a broker already holds: a delay server that fired a message and did not learn that a
broker stored it (killed while firing, or a failover to a replica that had not heard yet) fires it
again with the same id. The delay server marks its deliveries (`"once": true` on each message of a
BROKER_SEND, `ForwardedMessage`); a marked message whose id this broker already stored for the same
subject is answered as stored and not stored again, so consumers see it once.

The window is what the key index covers: the message log's retention (72 h by default), far longer
than any re-fire takes. Two copies in flight at the same moment are both stored (neither is in the
index yet); a re-fire comes seconds later. Unmarked sends (producers, the relay) are not looked up:
the hot path pays nothing.
"""

from __future__ import annotations

from typing import Any

from qmq.store.store import LogStore

ONCE_FIELD = "once"  # a message field: store it only if this broker does not hold its id already


def already_stored(store: LogStore, item: dict[str, Any], subject: str, message_id: str) -> bool:
    """Whether `item` (a message of a send, checked) is marked once and its id is stored already for
    `subject`. A few reads through the key index."""
    if item.get(ONCE_FIELD) is not True:
        return False
    return any(record.subject == subject for record in store.find_all_by_id(message_id))
