"""Administration requests (`qmq admin`): BROKER_RESET moves a group's cursor, BROKER_DEAD_LIST lists
a group's dead letters, BROKER_DEAD_REDRIVE sends them through the retry subject again, and
BROKER_STATS counts, per subject and group, what is stored, waiting, in flight, retrying and dead.
"""

from __future__ import annotations

import logging
from typing import Any

from qmq.broker.consumer_group import Reset
from qmq.broker.core import BrokerCore
from qmq.broker.journal import Create, Entry, GroupAction, Redriven
from qmq.broker.system_subjects import dead_subject, delivery, retry_subject, unwrap, wrap
from qmq.protocol.fields import bad, field, int_field
from qmq.protocol.limits import MAX_PULL_MESSAGES, validate_group, validate_subject

log = logging.getLogger("qmq.broker")

DEFAULT_DEAD_LIST_MAX = 100  # dead letters in one reply
REDRIVE_BATCH = 256  # dead letters read and appended at a time


class Administration:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core

    def _target(self, body: dict[str, Any]) -> tuple[str, str]:
        return validate_subject(field(body, "subject", str), limits=self.core.limits), validate_group(body.get("group"))

    async def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        core, store = self.core, self.core.store
        subject, group = self._target(body)
        to = body.get("to", "latest")
        if to == "earliest":
            cursor = store.first_seq(subject)
        elif to == "latest":
            cursor = store.next_seq(subject)
        elif isinstance(to, int) and not isinstance(to, bool) and to >= 0:
            cursor = min(max(to, store.first_seq(subject)), store.next_seq(subject))
        else:
            raise bad(f"'to' must be 'earliest', 'latest' or a sequence number, got {to!r}")
        entries: list[Entry] = []
        if core.state.group(subject, group) is None:
            entries.append(Create(subject, group, cursor, False))
        else:
            entries.append(GroupAction(subject, group, Reset(cursor)))
        await store.durable(core.apply_and_commit(entries))
        log.info("group %s on %s reset to %d", group, subject, cursor)
        return {"cursor": cursor}

    async def dead_list(self, body: dict[str, Any]) -> dict[str, Any]:
        subject, group = self._target(body)
        dead = dead_subject(subject, group)
        start = field(body, "from", int, self.core.state.redriven.get(dead, 0))
        max_count = int_field(body, "max", DEFAULT_DEAD_LIST_MAX, 1, MAX_PULL_MESSAGES)
        result = self.core.store.read(dead, start, max_count)
        messages = []
        for record in result.records:
            item = delivery(record)
            item["seq"] = record.seq
            item["reason"] = unwrap(record).reason
            messages.append(item)
        return {"messages": messages, "next": result.next_seq}

    async def redrive(self, body: dict[str, Any]) -> dict[str, Any]:
        core, store = self.core, self.core.store
        subject, group = self._target(body)
        dead = dead_subject(subject, group)
        seq, end, count, last = core.state.redriven.get(dead, 0), store.next_seq(dead), 0, 0
        while seq < end:
            result = store.read(dead, seq, REDRIVE_BATCH)
            if result.records:
                retry = retry_subject(subject, group)
                appended = store.append([wrap(r, retry, 1, "re-driven") for r in result.records])
                last = appended[-1].end
                count += len(result.records)
            if result.next_seq == seq:
                break
            seq = result.next_seq
        if seq > core.state.redriven.get(dead, 0):
            last = core.apply_and_commit([Redriven(dead, seq)])
        if last:
            await store.durable(last)
        core.wake({subject})
        log.info("%d dead letters of group %s on %s re-driven", count, group, subject)
        return {"redriven": count}

    async def stats_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    def stats(self) -> dict[str, Any]:
        """Per subject: stored; per (subject, group): backlog, in flight, retrying, dead, consumers."""
        state = self.core.state
        subjects = self.core.store.subjects()
        groups = []
        for (stored, key), group in state.groups.items():
            if stored.startswith("%"):
                continue
            retry = retry_subject(stored, key)
            retry_group = state.group(retry, key)
            retry_end = subjects.get(retry, 0)
            retry_backlog = retry_group.backlog(retry_end) if retry_group else retry_end
            dead = dead_subject(stored, key)
            groups.append(
                {
                    "subject": stored,
                    "group": key,
                    "backlog": group.backlog(subjects.get(stored, 0)) + retry_backlog,
                    "in_flight": group.in_flight() + (retry_group.in_flight() if retry_group else 0),
                    "retrying": state.retries.pending_for(retry) + retry_backlog,
                    "dead": subjects.get(dead, 0) - state.redriven.get(dead, 0),
                    "consumers": len(group.consumers),
                }
            )
        return {
            "group": self.core.group_name,
            "read_only": self.core.read_only,
            "subjects": {s: {"stored": n} for s, n in subjects.items() if not s.startswith("%")},
            "groups": groups,
        }
