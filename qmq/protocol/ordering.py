"""Ordered messages on the wire (docs/ordering.md), without I/O: which logical queue a key falls in,
and how a queue is named.

A message with an `order_key` is sent to the stored subject `subject#queue`, where `queue` is a
stable hash of the key modulo `ORDERED_QUEUES`; the meta server answers a route for `subject#queue`
with the one broker group that queue was given to (qmq/meta/ordering.py), so a key always goes to
one group and one consume log, and its messages are stored in the order they were sent. The key
itself travels in the envelope's `ORDER_KEY_HEADER`, for the worker, which handles one message of a
key at a time. The hash is blake2b, never Python's `hash()` (it changes between processes).
"""

from __future__ import annotations

import hashlib
import re

ORDERED_QUEUES = 64  # logical queues of an ordered subject (fixed in this version: keys never move)
ORDER_KEY_HEADER = "qmq-order-key"
QUEUE_SEPARATOR = "#"
QUEUE_SUBJECT_RE = re.compile(r"([A-Za-z0-9][A-Za-z0-9._\-]*)#([0-9]{1,4})")


def queue_of(order_key: str, queues: int = ORDERED_QUEUES) -> int:
    """The logical queue of `order_key`: the same in every process, on every host, for ever."""
    digest = hashlib.blake2b(order_key.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % queues


def queue_subject(subject: str, queue: int) -> str:
    """The stored subject of one queue of `subject`: `subject#queue`."""
    return f"{subject}{QUEUE_SEPARATOR}{queue}"


def split_queue_subject(stored: str) -> tuple[str, int] | None:
    """`("subject", queue)` for a queue subject `subject#queue`, None for any other subject."""
    match = QUEUE_SUBJECT_RE.fullmatch(stored)
    if match is None or int(match.group(2)) >= ORDERED_QUEUES:
        return None
    return match.group(1), int(match.group(2))


def base_subject(stored: str) -> str:
    """The producer's subject behind a queue subject (`subject#7` -> `subject`); others unchanged."""
    split = split_queue_subject(stored)
    return split[0] if split is not None else stored
