"""BROKER_SEND: each message of a send is checked on its own (a bad one is rejected, the others
stored); the sends of one loop iteration are stored together and acknowledged once durable (group
commit, `qmq.store.group_commit`). A read-only broker group takes none: the client sends elsewhere.
A delay server's delivery of a message already stored is answered as stored (`dedupe.py`).
"""

from __future__ import annotations

from typing import Any

from qmq.broker import metrics
from qmq.broker.core import BrokerCore
from qmq.broker.dedupe import ONCE_FIELD, already_stored
from qmq.compiled import load
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.fields import field
from qmq.protocol.limits import MAX_KEY_LEN, MAX_MESSAGE_ID_LEN, validate_sent_message
from qmq.store.group_commit import GroupCommit
from qmq.store.store import Message

_new_tuple = tuple.__new__
# The check of the common request, compiled (qmq/broker/_sending.pyx); None: the loop below for all.
compiled = load("qmq.broker._sending")


class Sending:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self._valid_subjects: set[str] = set()
        # Waiting pulls are woken once the messages are appended, not once they are durable: a pull's
        # reply waits for its own journal entry, which follows them in the same log, so one fsync
        # covers both.
        self.group_commit = GroupCommit(core.store, on_appended=lambda stored: core.wake({m.subject for m in stored}))

    async def send(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = field(body, "messages", list)
        if self.core.read_only:
            raise RemoteError(ErrorCode.READ_ONLY, f"broker group {self.core.group_name} is read-only: send elsewhere")
        rejected: list[list[Any]] = []
        repeated = 0
        limits = self.core.limits
        batch: list[Message] | None = None
        if compiled is not None:
            batch = compiled.plain_batch(
                messages, self._valid_subjects, limits.max_message_bytes, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN, Message
            )
        if batch is None:
            batch, repeated = self._check(messages, rejected)
        if batch:
            appended = await self.group_commit.write(batch)
            await self.core.replicated(appended[-1].end)  # a replicated group: enough replicas have it
            if len(batch) == 1:
                metrics.STORED.by_subject[batch[0].subject] += 1
            else:
                metrics.STORED.by_subject.update(m.subject for m in batch)
        return {"stored": len(batch) + repeated, "rejected": rejected}

    def _check(self, messages: list[Any], rejected: list[list[Any]]) -> tuple[list[Message], int]:
        """Each message checked on its own: the store's messages, and how many were stored already
        (`once`); the bad ones are added to `rejected`."""
        batch: list[Message] = []
        repeated = 0
        for index, item in enumerate(messages):
            try:
                m = validate_sent_message(item, self.core.limits, self._valid_subjects)
            except ProtocolError as exc:
                rejected.append([index, int(exc.code), exc.message])
                continue
            if item.get(ONCE_FIELD) is True and already_stored(self.core.store, m.subject, m.id):
                repeated += 1
                continue
            batch.append(_new_tuple(Message, (m.subject, m.id, m.payload, m.key, m.tags, 0)))  # Message(...), faster
        return batch, repeated
