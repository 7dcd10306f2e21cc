"""BROKER_SEND: each message of a send is checked on its own (a bad one is rejected, the others
stored); the sends of one loop iteration are stored together and acknowledged once durable (group
commit, `qmq.store.group_commit`). A read-only broker group takes none: the client sends elsewhere.
A delay server's delivery of a message already stored is answered as stored (`dedupe.py`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
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
        # Marked copies (`once`) being stored now, by (subject, id): a copy arriving meanwhile waits for
        # that send's outcome instead of being stored too, since neither is in the key index yet.
        self._once_storing: dict[tuple[str, str], asyncio.Future[None]] = {}

    async def send(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = field(body, "messages", list)
        if self.core.read_only:
            raise RemoteError(ErrorCode.READ_ONLY, f"broker group {self.core.group_name} is read-only: send elsewhere")
        rejected: list[list[Any]] = []
        checked: _Checked | None = None  # the compiled check takes no marked (`once`) messages
        limits = self.core.limits
        batch: list[Message] | None = None
        if compiled is not None:
            batch = compiled.plain_batch(
                messages, self._valid_subjects, limits.max_message_bytes, MAX_MESSAGE_ID_LEN, MAX_KEY_LEN, Message
            )
        if batch is None:
            checked = self._check(messages, rejected)
            batch = checked.batch
        if batch:
            await self._store(batch, checked.once if checked is not None else ())
            if len(batch) == 1:
                metrics.STORED.by_subject[batch[0].subject] += 1
            else:
                metrics.STORED.by_subject.update(m.subject for m in batch)
        if checked is None:
            return {"stored": len(batch), "rejected": rejected}
        for other in checked.waits:  # copies another send is storing: stored once that one is
            try:
                await asyncio.shield(other)
            except Exception as exc:
                raise RemoteError(
                    ErrorCode.UNAVAILABLE, f"another copy of a message in this send was not stored ({exc}): send again"
                ) from None
        return {"stored": len(batch) + checked.repeated, "rejected": rejected}

    async def _store(self, batch: list[Message], once: Sequence[tuple[str, str]]) -> None:
        """Append `batch` durably (and to enough replicas); its marked messages `once` are known as
        being stored until then."""
        if not once:
            appended = await self.group_commit.write(batch)
            await self.core.replicated(appended[-1].end)  # a replicated group: enough replicas have it
            return
        settled: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        for key in once:
            self._once_storing[key] = settled
        try:
            appended = await self.group_commit.write(batch)
            await self.core.replicated(appended[-1].end)
        except BaseException as exc:
            settled.set_exception(exc if isinstance(exc, Exception) else RuntimeError("the send was cancelled"))
            settled.exception()  # retrieved: nobody may be waiting
            raise
        else:
            settled.set_result(None)
        finally:
            for key in once:
                if self._once_storing.get(key) is settled:
                    del self._once_storing[key]

    def _check(self, messages: list[Any], rejected: list[list[Any]]) -> _Checked:
        """Each message checked on its own: the store's messages, how many were stored already or
        repeat another of the same send (`once`), the marked ones among them, and the sends storing
        copies of others; the bad ones are added to `rejected`."""
        checked = _Checked([], 0, [], [])
        seen: set[tuple[str, str]] = set()
        for index, item in enumerate(messages):
            try:
                m = validate_sent_message(item, self.core.limits, self._valid_subjects)
            except ProtocolError as exc:
                rejected.append([index, int(exc.code), exc.message])
                continue
            if item.get(ONCE_FIELD) is True:
                key = (m.subject, m.id)
                storing = self._once_storing.get(key)
                if key in seen or storing is not None or already_stored(self.core.store, m.subject, m.id):
                    checked.repeated += 1
                    if storing is not None:
                        checked.waits.append(storing)
                    continue
                seen.add(key)
                checked.once.append(key)
            checked.batch.append(_new_tuple(Message, (m.subject, m.id, m.payload, m.key, m.tags, 0)))  # faster
        return checked


@dataclass
class _Checked:
    batch: list[Message]  # to store
    repeated: int  # marked copies stored already, or being stored: answered as stored
    once: list[tuple[str, str]]  # (subject, id) of the marked messages in `batch`
    waits: list[asyncio.Future[None]]  # the outcomes of other sends storing copies of this one's
