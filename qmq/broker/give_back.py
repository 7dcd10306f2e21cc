"""Giving a consumer's unacknowledged messages back to its group: when it went silent for the consumer
timeout (the broker's sweep) or when it closed and said so (BROKER_LEAVE).

The messages are appended to the group's retry subject, due at once, where the rest of the group reads
them; the consumer's `Release` is journalled after them, so a crash in between delivers them twice,
never loses them. A message the consumer's application was handed counts as an attempt (one more,
or a dead letter past the broker's limit); one it fetched ahead and never saw keeps its attempt.
"""

from __future__ import annotations

from prometheus_client import Counter

from qmq.broker.consumer_group import ConsumerGroup, Release
from qmq.broker.core import BrokerCore
from qmq.broker.journal import GroupAction
from qmq.broker.metrics import REGISTRY
from qmq.broker.system_subjects import dead_subject, retry_subject, unwrap, user_subject, wrap

RELEASED = Counter(
    "qmq_broker_released_messages",
    "Unacknowledged messages given back to their group: why='silent' (consumer timeout) or 'left' (it closed)",
    ["why"],
    registry=REGISTRY,
)


def give_back(
    core: BrokerCore, group: ConsumerGroup, release: Release, handed: list[int], unseen: list[int], why: str
) -> tuple[int, int]:
    """Give back the consume-log sequences `handed` (an attempt made) and `unseen` (none made) of
    `group.subject`, then journal `release`. Returns how many messages moved and the log offset
    whose durability covers it all. Raises `StoreError` when the store cannot take them (nothing
    is released then)."""
    reason = f"consumer {release.consumer} {'left' if why == 'left' else 'went silent'}"
    messages = []
    for seqs, tried in ((handed, True), (unseen, False)):
        for record in core.store.records(group.subject, seqs):
            original = unwrap(record)
            attempt = original.attempt + 1 if tried else original.attempt
            to = (dead_subject if attempt > core.max_attempts else retry_subject)(original.subject, group.group)
            messages.append(wrap(record, to, attempt, reason if tried else original.reason))
    if messages:
        core.store.append(messages)
    end = core.apply_and_commit([GroupAction(group.subject, group.group, release)])
    core.wake({user_subject(group.subject)})
    RELEASED.labels(why).inc(len(messages))
    return len(messages), end
