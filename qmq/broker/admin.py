"""Administration requests (`qmq admin`, `qmq console`): BROKER_RESET moves a group's cursor,
BROKER_GROUP_CREATE and BROKER_GROUP_DELETE make and remove a consumer group, BROKER_DEAD_LIST lists
a group's dead letters, BROKER_DEAD_REDRIVE sends them (all, or some) through the retry subject
again, BROKER_DEAD_PURGE drops them, BROKER_STATS counts, per subject and group, what is stored,
waiting, in flight, retrying and dead with the rates of the last minute, and BROKER_CONSUMERS lists
every consumer with what its worker reported in its heartbeats. BROKER_LOOKUP is `lookup.py`.

Every change goes through the journal and is durable before the reply, like a pull or an ack.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from qmq.broker.consumer_group import Reset
from qmq.broker.core import BrokerCore
from qmq.broker.journal import Create, Delete, Entry, Fired, GroupAction, Redriven
from qmq.broker.system_subjects import REDRIVEN_REASON, dead_subject, delivery, retry_subject, unwrap, wrap
from qmq.protocol.fields import bad, field, int_field
from qmq.protocol.limits import MAX_PULL_MESSAGES, validate_group, validate_subject
from qmq.store.store import LogStore

log = logging.getLogger("qmq.broker")

DEFAULT_DEAD_LIST_MAX = 100  # dead letters in one reply
REDRIVE_BATCH = 256  # dead letters read and appended at a time
MAX_SEQS = 4096  # dead letters named in one re-drive or purge
RATE_SAMPLE_S = 5.0  # the counters behind the rates are sampled this often...
RATE_WINDOW_S = 60.0  # ...and a rate is over this much of the past (less just after a start)
MAX_REPORTED_RUNNING = 256  # messages a worker's heartbeat may name as running
REPORT_KEEP_S = 600.0  # a worker's report is forgotten this long after its last heartbeat


def seq_at_time(store: LogStore, subject: str, time_ms: int) -> int:
    """The first sequence of `subject` stored at or after `time_ms` (the end when none is): a binary
    search on the consume log's store times."""
    low, high = store.first_seq(subject), store.next_seq(subject)
    while low < high:
        mid = (low + high) // 2
        entries = store.entries(subject, mid, 1)
        if entries and (entries[0] is None or entries[0].store_ts < time_ms):
            low = mid + 1
        else:
            high = mid
    return low


class RateMeter:
    """Counters sampled every RATE_SAMPLE_S, so a rate is a difference over the last RATE_WINDOW_S.
    No I/O; the caller passes the time."""

    def __init__(self) -> None:
        self.samples: deque[tuple[float, dict[Any, int]]] = deque()

    def sample(self, now: float, counters: dict[Any, int]) -> None:
        self.samples.append((now, counters))
        while len(self.samples) > 1 and self.samples[1][0] <= now - RATE_WINDOW_S:
            self.samples.popleft()

    def rate(self, now: float, name: Any, value: int) -> float | None:
        """Per second since the oldest sample in the window; None before there is one."""
        if not self.samples:
            return None
        then, counters = self.samples[0]
        if now - then < 1.0:
            return None
        return max(0.0, (value - counters.get(name, 0)) / (now - then))


class Administration:
    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self.rates = RateMeter()
        self.reports: dict[str, tuple[float, dict[str, Any]]] = {}  # consumer id -> (time, worker report)
        self._sampler: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._sampler = asyncio.create_task(self._sample_loop())

    async def stop(self) -> None:
        if self._sampler is not None:
            self._sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sampler

    def _target(self, body: dict[str, Any]) -> tuple[str, str]:
        return validate_subject(field(body, "subject", str), limits=self.core.limits), validate_group(body.get("group"))

    # ---- positions ------------------------------------------------------------------------------

    def _cursor(self, subject: str, body: dict[str, Any]) -> int:
        """Where "to" (earliest, latest or a sequence) or "time_ms" puts a group's cursor."""
        store = self.core.store
        if "time_ms" in body:
            return seq_at_time(store, subject, field(body, "time_ms", int))
        to = body.get("to", "latest")
        if to == "earliest":
            return store.first_seq(subject)
        if to == "latest":
            return store.next_seq(subject)
        if isinstance(to, int) and not isinstance(to, bool) and to >= 0:
            return min(max(to, store.first_seq(subject)), store.next_seq(subject))
        raise bad(f"'to' must be 'earliest', 'latest' or a sequence number, got {to!r}")

    async def reset(self, body: dict[str, Any]) -> dict[str, Any]:
        subject, group = self._target(body)
        cursor = self._cursor(subject, body)
        entries: list[Entry] = []
        if self.core.state.group(subject, group) is None:
            entries.append(Create(subject, group, cursor, False))
        else:
            entries.append(GroupAction(subject, group, Reset(cursor)))
        await self.core.store.durable(self.core.apply_and_commit(entries))
        log.info("group %s on %s reset to %d", group, subject, cursor)
        return {"cursor": cursor}

    async def group_create(self, body: dict[str, Any]) -> dict[str, Any]:
        """A consumer group before its first consumer, starting where asked (a first pull would start
        it at its own `start`); an existing group is left as it is."""
        subject, group = self._target(body)
        existing = self.core.state.group(subject, group)
        if existing is not None:
            return {"created": False, "cursor": existing.cursor}
        cursor = self._cursor(subject, body)
        await self.core.store.durable(self.core.apply_and_commit([Create(subject, group, cursor, False)]))
        log.info("group %s on %s created at %d", group, subject, cursor)
        return {"created": True, "cursor": cursor}

    async def group_delete(self, body: dict[str, Any]) -> dict[str, Any]:
        """Forget a consumer group: its position, its consumers' pull logs, its pending retries and
        its dead letters. Refused while one of its consumers was seen within the consumer timeout,
        unless "force"."""
        core = self.core
        subject, group = self._target(body)
        found = core.state.group(subject, group)
        if found is None:
            return {"deleted": False}
        retry, dead = retry_subject(subject, group), dead_subject(subject, group)
        now = core.clock()
        live = [
            cid
            for g in (found, core.state.group(retry, group))
            if g is not None
            for cid, c in g.consumers.items()
            if now - c.last_seen < core.consumer_timeout_s
        ]
        if live and not field(body, "force", bool, False):
            raise bad(
                f"group {group!r} on {subject!r} has live consumers ({', '.join(sorted(set(live)))}): stop them "
                "first, or force"
            )
        pending = tuple(e.id for e in core.state.retries.entries() if e.retry_subject == retry)
        entries: list[Entry] = [Delete(subject, group, core.store.next_seq(retry), core.store.next_seq(dead))]
        if pending:
            entries.append(Fired(pending))
        await core.store.durable(core.apply_and_commit(entries))
        log.warning("group %s on %s deleted (%d pending retries dropped)", group, subject, len(pending))
        return {"deleted": True}

    # ---- dead letters ---------------------------------------------------------------------------

    async def dead_list(self, body: dict[str, Any]) -> dict[str, Any]:
        subject, group = self._target(body)
        dead = dead_subject(subject, group)
        state = self.core.state
        start = field(body, "from", int, state.redriven.get(dead, 0))
        max_count = int_field(body, "max", DEFAULT_DEAD_LIST_MAX, 1, MAX_PULL_MESSAGES)
        messages: list[dict[str, Any]] = []
        seq = start
        while len(messages) < max_count:
            result = self.core.store.read(dead, seq, max_count - len(messages))
            for record in result.records:
                if state.dead_is_done(dead, record.seq):
                    continue
                item = delivery(record)
                item["seq"] = record.seq
                item["reason"] = unwrap(record).reason
                item["dead_at"] = record.store_ts
                messages.append(item)
            if result.next_seq == seq:
                break
            seq = result.next_seq
        return {"messages": messages, "next": seq}

    def _seqs(self, body: dict[str, Any]) -> list[int] | None:
        """The dead letters named by "seqs", or None for all of them."""
        if "seqs" not in body:
            return None
        seqs = field(body, "seqs", list)
        if len(seqs) > MAX_SEQS or not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seqs):
            raise bad(f"field 'seqs' must be a list of at most {MAX_SEQS} dead-letter sequences")
        return sorted(set(seqs))

    async def redrive(self, body: dict[str, Any]) -> dict[str, Any]:
        """Send dead letters (all not yet handled, or those of "seqs") back to their group through its
        retry subject, attempt 1 again."""
        subject, group = self._target(body)
        retry = retry_subject(subject, group)
        count = await self._handle_dead(
            subject, group, self._seqs(body), lambda records: [wrap(r, retry, 1, REDRIVEN_REASON) for r in records]
        )
        self.core.wake({subject})
        log.info("%d dead letters of group %s on %s re-driven", count, group, subject)
        return {"redriven": count}

    async def purge(self, body: dict[str, Any]) -> dict[str, Any]:
        """Drop dead letters (all not yet handled, or those of "seqs"): they stay in the log until
        retention, but are no longer listed, counted or re-driven."""
        subject, group = self._target(body)
        count = await self._handle_dead(subject, group, self._seqs(body), None)
        log.warning("%d dead letters of group %s on %s purged", count, group, subject)
        return {"purged": count}

    async def _handle_dead(self, subject: str, group: str, seqs: list[int] | None, copies: Any) -> int:
        """Re-drive (`copies` makes the retry copies) or purge (`copies` None) dead letters; how many."""
        core, store, state = self.core, self.core.store, self.core.state
        dead = dead_subject(subject, group)
        mark, end = state.redriven.get(dead, 0), store.next_seq(dead)
        wanted = [s for s in seqs if mark <= s < end] if seqs is not None else None
        handled: list[int] = []
        last = 0
        seq = mark
        while seq < end:
            if wanted is not None:
                batch = [s for s in wanted if seq <= s][:REDRIVE_BATCH]
                if not batch:
                    break
                records, seq = store.records(dead, batch), batch[-1] + 1
            else:
                result = store.read(dead, seq, REDRIVE_BATCH)
                records = result.records
                if result.next_seq == seq:
                    break
                seq = result.next_seq
            records = [r for r in records if not state.dead_is_done(dead, r.seq)]
            if records and copies is not None:
                last = store.append(copies(records))[-1].end
            handled.extend(r.seq for r in records)
        if wanted is None and seq > mark:
            entry = Redriven(dead, seq, (), copies is None)
        elif handled:
            entry = Redriven(dead, mark, tuple(handled), copies is None)
        else:
            entry = None
        if entry is not None:
            last = core.apply_and_commit([entry])
        if last:
            await store.durable(last)
        return len(handled)

    # ---- figures --------------------------------------------------------------------------------

    async def stats_request(self, body: dict[str, Any]) -> dict[str, Any]:
        return self.stats()

    def _counters(self) -> tuple[dict[str, int], dict[tuple[str, str], int]]:
        """Messages stored per subject, and acknowledged per (subject, group) (retries included)."""
        state = self.core.state
        acked: dict[tuple[str, str], int] = {}
        for (stored, key), group in state.groups.items():
            done = sum(c.pull_log.ack_seq for c in group.consumers.values())
            target = (stored, key) if not stored.startswith("%") else (stored[1:].split("%")[1], key)
            acked[target] = acked.get(target, 0) + done
        return self.core.store.subjects(), acked

    async def _sample_loop(self) -> None:
        while True:
            stored, acked = self._counters()
            self.rates.sample(time.monotonic(), {**stored, **acked})
            await asyncio.sleep(RATE_SAMPLE_S)  # a period, not a wait for an event

    def stats(self) -> dict[str, Any]:
        """Per subject: stored, the rate in ("in_rates") and the pulls waiting ("pulls_waiting"); per
        (subject, group): backlog, in flight, retrying, dead, consumers, acknowledged and the rate out
        (messages per second over the last minute)."""
        state = self.core.state
        subjects, acked = self._counters()
        now = time.monotonic()
        groups = []
        for (stored, key), group in state.groups.items():
            if stored.startswith("%"):
                continue
            retry = retry_subject(stored, key)
            retry_group = state.group(retry, key)
            retry_end = subjects.get(retry, 0)
            retry_backlog = retry_group.backlog(retry_end) if retry_group else retry_end
            dead = dead_subject(stored, key)
            done = acked.get((stored, key), 0)
            groups.append(
                {
                    "subject": stored,
                    "group": key,
                    "backlog": group.backlog(subjects.get(stored, 0)) + retry_backlog,
                    "in_flight": group.in_flight() + (retry_group.in_flight() if retry_group else 0),
                    "retrying": state.retries.pending_for(retry) + retry_backlog,
                    "dead": state.dead_pending(dead, subjects.get(dead, 0)),
                    "consumers": len(group.consumers),
                    "broadcast": group.broadcast,
                    "acked": done,
                    "out_rate": self.rates.rate(now, (stored, key), done),
                }
            )
        store_reason = self.core.store.read_only_reason
        return {
            "group": self.core.group_name,
            "read_only": self.core.read_only or store_reason is not None,
            # set by the meta server (sends go elsewhere) or by the store (disk full, I/O error)
            "damaged_records": len(self.core.store.damaged) + len(self.core.store.unreadable),
            "read_only_reason": store_reason
            or (f"broker group {self.core.group_name} is read-only (meta server)" if self.core.read_only else None),
            "subjects": {s: {"stored": n} for s, n in subjects.items() if not s.startswith("%")},
            "in_rates": {s: self.rates.rate(now, s, n) for s, n in subjects.items() if not s.startswith("%")},
            "groups": groups,
            "pulls_waiting": self.core.waiting_pulls(),  # long polls held open, per subject
        }

    # ---- consumers and their workers ------------------------------------------------------------

    def note_report(self, consumers: list[str], report: Any) -> None:
        """A heartbeat's worker report (`qmq admin inspect`), kept for each consumer id it names."""
        if not isinstance(report, dict):
            raise bad("field 'worker' must be a map")
        running = report.get("running")
        if isinstance(running, list) and len(running) > MAX_REPORTED_RUNNING:
            report = {**report, "running": running[:MAX_REPORTED_RUNNING], "running_cut": len(running)}
        now = self.core.clock()
        for consumer in consumers:
            self.reports[consumer] = (now, report)
        for consumer, (at, _report) in list(self.reports.items()):
            if now - at > REPORT_KEEP_S:
                del self.reports[consumer]

    async def consumers(self, body: dict[str, Any]) -> dict[str, Any]:
        """BROKER_CONSUMERS: every consumer of every group (seen how long ago, messages held), and the
        reports of their workers."""
        core = self.core
        now = core.clock()
        out = []
        for (stored, key), group in core.state.groups.items():
            for consumer_id, consumer in group.consumers.items():
                out.append(
                    {
                        "subject": stored,
                        "group": key,
                        "consumer": consumer_id,
                        "in_flight": consumer.pull_log.unacked,
                        "seen_s_ago": round(now - consumer.last_seen, 3),
                        "alive": now - consumer.last_seen < core.consumer_timeout_s,
                    }
                )
        workers = {cid: {**report, "reported_s_ago": round(now - at, 3)} for cid, (at, report) in self.reports.items()}
        return {"broker_group": core.group_name, "consumers": out, "workers": workers}
