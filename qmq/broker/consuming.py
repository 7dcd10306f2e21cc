"""Consumer requests: BROKER_PULL (long polling), BROKER_ACK, BROKER_NACK, BROKER_LEAVE and
BROKER_HEARTBEAT.

A pull hands a consumer its group's next messages, due retries first, journals the pull and replies
once that is durable; it waits (up to `wait_ms`) for new messages when there are none. Acks move the
consumer's ack offset; a nack schedules a retry after the delay asked for, or dead-letters the
message, and is answered once that is durable and, in a replicated group, held by the replicas.
Promises: a message is never handed to two live consumers of a group at once; an ack or nack naming
a group, consumer or pull sequence this broker never served is UNKNOWN_CONSUMER, for that request
alone (after a failover a correct client may name what only the old master handed out); the acks
of one request before a bad one are kept; a pull naming as received pull sequences never handed out
here is answered `behind` and handed nothing new (see `behind`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from dataclasses import dataclass
from typing import Any

from qmq.broker.ahead import AHEAD_WINDOW_S, ServeAhead
from qmq.broker.consumer_group import ConsumerGroup, UnknownConsumer
from qmq.broker.core import BrokerCore
from qmq.broker.give_back import give_back
from qmq.broker.journal import Create, Entry, GroupAction, Schedule
from qmq.broker.ordered import not_held, ordered_queues, stored_subjects
from qmq.broker.queue_lease import KeyStopped
from qmq.broker.system_subjects import dead_subject, delivery, retry_subject, unwrap, user_subject, wrap
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.fields import bad, choice_field, field, int_field
from qmq.protocol.limits import (
    MAX_PULL_MESSAGES,
    MAX_PULL_WAIT_MS,
    Limits,
    validate_consumer,
    validate_group,
    validate_subject,
    validate_tags,
)
from qmq.protocol.ordering import split_queue_subject
from qmq.store import record as rec
from qmq.store.store import Message, StoreError

log = logging.getLogger("qmq.broker")

DEFAULT_PULL_MAX = 64  # messages
DEFAULT_WAIT_MS = 2500  # long polling
MAX_NACK_DELAY_MS = 10 * 365 * 86400 * 1000
MAX_NACK_ATTEMPTS = 1_000_000
MAX_REASON_LEN = 1000  # characters of a nack's reason kept
LEFT_KEPT_S = MAX_PULL_WAIT_MS / 1000 + 1.0  # a consumer's leave outlives any pull it had waiting
# An ack's journal entry waits this long for another request's fsync to cover it before asking for one.
ACK_FLUSH_LINGER_S = 0.002
NOTHING_TO_RESEND = 1 << 62  # as a pull's `pulled`: take new messages only (serving ahead)


def broadcast_key(group: str, consumer: str) -> str:
    """A broadcast consumer's own group key: short, so retry subjects stay valid names."""
    return f"{group}.bc-{hashlib.sha1(consumer.encode()).hexdigest()[:12]}"


def unknown(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.UNKNOWN_CONSUMER, message, fatal=False)


@dataclass(frozen=True)
class PullRequest:
    """A BROKER_PULL body, checked."""

    subject: str
    key: str  # the group, or a broadcast consumer's own key
    consumer: str
    max_count: int
    wait_ms: int
    tags: tuple[str, ...]
    match_all: bool
    broadcast: bool
    start: str  # where a new group starts: "latest" or "earliest"
    pulled: dict[str, int]  # stored subject -> the last pull sequence the consumer has seen
    queues: tuple[int, ...] | None = None  # an ordered pull: these queues of the subject (their holder)
    ahead: int = 0  # serve up to this many new messages ahead until the next pull (ahead.py)

    @classmethod
    def of(cls, body: dict[str, Any], limits: Limits) -> PullRequest:
        subject = validate_subject(field(body, "subject", str), limits=limits)
        group = validate_group(body.get("group"))
        consumer = validate_consumer(body.get("consumer"))
        max_count = int_field(body, "max", DEFAULT_PULL_MAX, 1, MAX_PULL_MESSAGES)
        wait_ms = int_field(body, "wait_ms", DEFAULT_WAIT_MS, 0, MAX_PULL_WAIT_MS)
        tags = validate_tags(field(body, "tags", list, []))
        match_all = bool(body.get("match_all", False))
        broadcast = bool(body.get("broadcast", False))
        start = choice_field(body, "start", ("latest", "earliest"), "latest")
        pulled = field(body, "pulled", dict, {})
        for stored, last in pulled.items():
            if not isinstance(stored, str) or not isinstance(last, int) or isinstance(last, bool):
                raise bad(f"pulled must map stored subjects to pull sequences, got {stored!r}: {last!r}")
        queues = ordered_queues(body)
        if queues is not None and broadcast:
            raise bad("an ordered pull (queues) cannot be a broadcast")
        ahead = int_field(body, "ahead", 0, 0, MAX_PULL_MESSAGES) if queues is None and not broadcast else 0
        key = broadcast_key(group, consumer) if broadcast else group
        if len(retry_subject(subject, key)) > limits.max_subject_len:
            raise bad(
                f"subject {subject!r} and group {key!r} together are too long for the retry subject "
                f"(at most {limits.max_subject_len} characters)"
            )
        return cls(subject, key, consumer, max_count, wait_ms, tags, match_all, broadcast, start, pulled, queues, ahead)


def unnamed_siblings(leaves: list[Any]) -> list[list[Any]]:
    """A client's BROKER_LEAVE names the stored subjects it received from. Of the others of the same
    subject and group (the subject itself, the group's retry subject) it received nothing, yet the
    consumer may hold messages there, served ahead (ahead.py) while it closed: they go back too,
    all unseen (`seen` -1), so they keep their attempt and need not wait for the consumer timeout."""
    named = {(stored, key, consumer) for stored, key, consumer, _ in leaves}
    siblings: list[list[Any]] = []
    for stored, key, consumer, _ in leaves:
        if stored.startswith("%") and not (stored.startswith("%RETRY%") and stored.count("%") >= 3):
            continue  # not a subject of a plain group: nothing is served ahead there
        subject = user_subject(stored)
        if split_queue_subject(subject) is not None:  # ordered queues move with their leases
            continue
        for sibling in (subject, retry_subject(subject, key)):
            if (sibling, key, consumer) not in named:
                named.add((sibling, key, consumer))
                siblings.append([sibling, key, consumer, -1])
    return siblings


def behind(stored: str, pull: PullRequest, pulled: int, next_pull: int) -> dict[str, Any]:
    """The answer to a consumer that names pull sequences this broker never handed out: an empty batch
    numbered where this broker's pull log for it ends, which tells the client to forget what it holds
    from this group and pull again naming nothing (it then gets every message not acknowledged here).
    Nothing new is handed out before that: its acks of sequences it got elsewhere must not cover them."""
    log.info(
        "consumer %r of group %r on %s names pull %d received, but this broker handed out only %d:"
        " its state is behind the consumer's (a failover?); the consumer starts over from its acknowledged point",
        pull.consumer,
        pull.key,
        stored,
        pulled,
        next_pull,
    )
    return {
        "subject": stored,
        "group": pull.key,
        "first_pull": next_pull,
        "resent": False,
        "behind": True,
        "messages": [],
    }


class Consuming:
    def __init__(self, core: BrokerCore, ahead_window_s: float = AHEAD_WINDOW_S) -> None:
        self.core = core
        self.dead_lettered: set[tuple[str, str, int]] = set()  # unreadable messages sent to dead letters
        # consumer id -> loop time of its BROKER_LEAVE: a pull of it waiting since before then hands
        # out nothing more (its reply would go nowhere). Kept for one pull's longest wait.
        self.left_at: dict[str, float] = {}
        self.ahead = ServeAhead(core, self._take_ahead, ahead_window_s)

    # ---- pull -----------------------------------------------------------------------------------

    async def pull(self, body: dict[str, Any]) -> dict[str, Any]:
        pull = PullRequest.of(body, self.core.limits)
        self.ahead.back(pull)
        started = asyncio.get_running_loop().time()
        reply = await self._pull(pull, started)
        if pull.ahead and not reply["batches"] and self.left_at.get(pull.consumer, -1.0) < started:
            self.ahead.answering(pull, 0)  # answered empty (a pull with messages counted itself away)
        return reply

    async def _pull(self, pull: PullRequest, started: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        deadline = started + pull.wait_ms / 1000
        while True:
            if self.left_at and self.left_at.get(pull.consumer, -1.0) >= started:
                return {"batches": []}  # the consumer left while this pull waited
            batches, end = self._take(pull)
            if batches and pull.ahead:  # from now: what comes during the fsync below is its next
                self.ahead.answering(pull, sum(len(b["messages"]) for b in batches))
            if batches and self.ahead.reserved_end:  # what was served ahead goes out once journalled
                end = max(end or 0, self.ahead.reserved_end)
            if end is not None:
                await self.core.store.durable(end)
            lost = not_held(self.core, pull)
            if batches or (lost and pull.queues is not None and len(lost) == len(pull.queues)):
                return {"batches": batches, "lost": lost} if lost else {"batches": batches}
            remaining = deadline - loop.time()
            if remaining <= 0 or not await self.core.wait_for_messages(pull.subject, remaining):
                return {"batches": [], "lost": lost} if lost else {"batches": []}

    def _take(self, pull: PullRequest, *, ahead: int = 0) -> tuple[list[dict], int | None]:
        """Hand the consumer its next messages: due retries first, then the subject. Returns the
        batches and the log offset to await before replying (None when nothing was journalled).
        Whatever was applied is journalled, even when a read fails half-way. `ahead`: serve up to
        that many new messages before the consumer asks (ahead.py), resending nothing."""
        entries: list[Entry] = []
        batches: list[dict] = []
        try:
            self._take_into(entries, batches, pull, ahead)
        except BaseException:
            if entries:  # what it applied may be handed out by a later pull: that one waits for this entry
                self.ahead.journalled(self.core.commit(entries, delivery=True))
            raise
        return batches, (self.core.commit(entries, delivery=True) if entries else None)

    def _take_ahead(self, pull: PullRequest, count: int) -> tuple[list[dict], int | None]:
        return self._take(pull, ahead=count)

    def _take_into(self, entries: list[Entry], batches: list[dict], pull: PullRequest, ahead: int) -> None:
        core, store = self.core, self.core.store
        now = core.clock()
        remaining = ahead or pull.max_count
        for retry, stored in stored_subjects(core, pull, now):
            group = core.state.group(stored, pull.key)
            if group is None:
                if stored == retry and not store.next_seq(retry):
                    continue
                if stored == retry:
                    cursor = 0
                else:
                    cursor = store.first_seq(stored) if pull.start == "earliest" else store.next_seq(stored)
                create = Create(stored, pull.key, cursor, pull.broadcast)
                core.state.apply(create, now)
                entries.append(create)
                group = core.state.groups[(stored, pull.key)]
            if remaining <= 0:
                break
            fresh: dict[int, rec.Record] = {}

            def read(cursor: int, count: int, stored: str = stored, fresh: dict = fresh) -> tuple[list[int], int]:
                result = store.read(stored, cursor, count, tags=pull.tags, match_all=pull.match_all)
                records, next_seq = result.records, result.next_seq
                if store.unreadable:
                    held = store.damage.held_back(stored, cursor, next_seq)
                    if held is not None:  # a group member's copy may mend it: wait there, skip nothing
                        records, next_seq = [r for r in records if r.seq < held], held
                    self._dead_letter_unreadable(stored, pull.subject, pull.key, cursor, next_seq)
                for record in records:
                    fresh[record.seq] = record
                return [r.seq for r in records], next_seq

            pulled = NOTHING_TO_RESEND if ahead else pull.pulled.get(stored, -1)
            if not ahead and pulled >= (next_pull := group.next_pull(pull.consumer)):
                batches.append(behind(stored, pull, pulled, next_pull))
                continue
            handed, action = group.pull(pull.consumer, pulled, remaining, read, now)
            if action is not None:
                entries.append(GroupAction(stored, pull.key, action))
            if handed.seqs:
                records = [fresh[s] for s in handed.seqs] if not handed.resent else store.records(stored, handed.seqs)
                batches.append(
                    {
                        "subject": stored,
                        "group": pull.key,
                        "first_pull": handed.first_pull,
                        "resent": handed.resent,
                        "messages": [delivery(r) for r in records],
                    }
                )
                remaining -= len(handed.seqs)

    def _dead_letter_unreadable(self, stored: str, subject: str, key: str, start: int, end: int) -> None:
        """Messages of `stored` between `start` and `end` the store could not read (damaged in the
        message log, store.py) go to the group's dead letters with the reason (file and offset), once
        per group, so the group moves on and the loss is visible (`qmq admin dead list`). The dead
        letter has the message's place but not its content (id `unreadable:<subject>:<seq>`)."""
        store = self.core.store
        for (unreadable_subject, seq), reason in list(store.unreadable.items()):
            done_key = (stored, key, seq)
            if unreadable_subject != stored or not start <= seq < end or done_key in self.dead_lettered:
                continue
            placeholder = rec.Record(
                -1, 0, 0, 0, int(self.core.clock() * 1000), seq, stored, f"unreadable:{stored}:{seq}", None, (), b""
            )
            try:
                store.append([wrap(placeholder, dead_subject(subject, key), 1, f"unreadable: {reason}")])
            except StoreError:
                return  # read-only now: the next read past it tries again
            self.dead_lettered.add(done_key)
            log.error("%s seq %d of group %r cannot be read: dead-lettered (%s)", stored, seq, key, reason)

    # ---- ack, nack, heartbeat ---------------------------------------------------------------------

    def _known_group(self, stored: Any, key: Any) -> ConsumerGroup:
        group = self.core.state.group(stored, key) if isinstance(stored, str) and isinstance(key, str) else None
        if group is None:
            raise unknown(f"group {key!r} never pulled {stored!r} from this broker")
        return group

    async def ack(self, body: dict[str, Any]) -> dict[str, Any]:
        entries: list[Entry] = []
        now = self.core.clock()
        acks = field(body, "acks", list)
        error: ProtocolError | None = None
        for item in acks:  # all checked before any is applied
            if (
                not isinstance(item, list | tuple)
                or len(item) != 4
                or not isinstance(item[3], int)
                or isinstance(item[3], bool)
            ):
                raise bad("each ack must be [subject, group, consumer, last_pull]")
            validate_consumer(item[2])
            self._known_group(item[0], item[1])
        for stored, key, consumer, last_pull in acks:
            group = self._known_group(stored, key)
            try:
                action = group.ack(consumer, last_pull, now)
            except UnknownConsumer as exc:
                error = unknown(str(exc))
                break
            except ValueError as exc:
                error = unknown(f"consumer {consumer!r} of group {key!r} on {stored!r}: {exc}")
                break
            if action is not None:
                entries.append(GroupAction(stored, key, action))
        if entries:  # the acks before a bad one are applied: journal them too
            end = self.core.commit(entries, delivery=True)
            if error is not None:
                raise error
            # Answered once durable, as ever; but an ack is not waited for on the way of any message
            # (clients send them in flight or in batches), so it rides the next send's or pull's fsync
            # rather than putting one of its own in series before theirs.
            await self.core.store.durable(end, linger_s=ACK_FLUSH_LINGER_S)
        elif error is not None:
            raise error
        return {}

    async def nack(self, body: dict[str, Any]) -> dict[str, Any]:
        core = self.core
        outcomes: list[list[Any]] = []
        entries: list[Entry] = []
        stops: list[Entry] = []
        dead: list[Message] = []
        now = core.clock()
        for item in field(body, "nacks", list):
            if not isinstance(item, dict):
                raise bad("each nack must be a map")
            stored, key = item.get("subject"), item.get("group")
            consumer = validate_consumer(item.get("consumer"))
            group = self._known_group(stored, key)
            pull_seq = field(item, "pull_seq", int)
            attempt = field(item, "attempt", int, 1)
            delay_ms = int_field(item, "delay_ms", 0, 0, MAX_NACK_DELAY_MS)
            max_attempts = int_field(item, "max_attempts", core.max_attempts, 1, MAX_NACK_ATTEMPTS)
            reason = str(item.get("reason") or "")[:MAX_REASON_LEN]
            state = group.consumers.get(consumer)
            if state is None:
                raise unknown(f"consumer {consumer!r} never pulled {stored!r} as group {key!r}")
            if pull_seq < state.pull_log.ack_seq:
                outcomes.append(["acked", None])  # already done: nothing to retry
                continue
            try:
                seq = state.pull_log.lookup(pull_seq, pull_seq)[0]
            except KeyError as exc:
                raise unknown(f"consumer {consumer!r}: {exc}") from None
            state.last_seen = now
            records = core.store.records(stored, [seq])
            if not records:
                outcomes.append(["gone", None])  # removed by retention
                continue
            record = records[0]
            original = unwrap(record)
            attempt = max(attempt, original.attempt)
            if item.get("dead") or attempt >= max_attempts:
                why = reason or f"failed {attempt} attempts"
                dead.append(wrap(record, dead_subject(original.subject, key), attempt, why))
                outcomes.append(["dead", None])
                if isinstance(item.get("stop_key"), str):  # an ordered key stops behind it (docs/ordering.md)
                    stops.append(KeyStopped(original.subject, key, item["stop_key"]))
            else:
                due_ms = int(now * 1000) + delay_ms
                entries.append(
                    Schedule(
                        core.state.retries.next_id + len(entries),
                        due_ms,
                        record.offset,
                        attempt + 1,
                        retry_subject(original.subject, key),
                        reason,
                    )
                )
                outcomes.append(["retry", due_ms])
        end = 0
        if dead:
            appended = core.store.append(dead)
            end = appended[-1].end
            for outcome, message in zip((o for o in outcomes if o[0] == "dead"), appended, strict=True):
                outcome[1] = message.seq
            log.info("%d messages dead-lettered", len(dead))
        if entries:
            end = core.apply_and_commit(entries)
            core.retries_changed.set()
        if stops:  # after the dead letters: a crash in between resends the message, never loses it
            end = core.apply_and_commit(stops)
        if end:
            await core.store.durable(end)
            await self._replicated(end)
        return {"outcomes": outcomes}

    async def _replicated(self, end: int) -> None:
        """A nack's answer promises its retry (or dead letter): the consumer counts the message done,
        and its acks, sent again to whichever master comes next, cover it. So the in-sync replicas,
        the only ones the meta server promotes, must hold it first, as for a send. While none is in
        sync the group is read-only and no replica can take over, so the master's disk is enough:
        refusing would deliver the message again and again until a replica caught up (which copies
        the retry with the rest). Not so for a master out of office (fenced from the meta server,
        which may have promoted a replica meanwhile, or handing off): READ_ONLY."""
        try:
            await self.core.replicated(end)
        except RemoteError as exc:
            if exc.code != ErrorCode.READ_ONLY or not self.core.in_office():
                raise
            log.info("nack answered with its retry on this master's disk alone: %s", exc)

    async def leave(self, body: dict[str, Any]) -> dict[str, Any]:
        """BROKER_LEAVE: a consumer that closes gives back what it holds unacknowledged at once,
        rather than after the consumer timeout. `seen` is the last pull sequence its application was
        handed: messages after it were fetched ahead, never tried, and keep their attempt. A group or
        consumer this broker does not know holds nothing here: nothing to do. Ordered queues move
        with their leases instead (BROKER_QUEUE_LOCK with `leave`)."""
        core = self.core
        leaves = field(body, "leaves", list)
        for item in leaves:  # all checked before any is applied
            if (
                not isinstance(item, list | tuple)
                or len(item) != 4
                or not all(isinstance(x, str) for x in item[:3])
                or not isinstance(item[3], int)
                or isinstance(item[3], bool)
            ):
                raise bad("each leave must be [subject, group, consumer, seen]")
            validate_consumer(item[2])
        now = asyncio.get_running_loop().time()
        self.left_at = {c: t for c, t in self.left_at.items() if t > now - LEFT_KEPT_S}
        self.left_at.update((item[2], now) for item in leaves)
        self.ahead.left(item[2] for item in leaves)
        released, end = 0, 0
        for stored, key, consumer, seen in [*leaves, *unnamed_siblings(leaves)]:
            group = core.state.group(stored, key)
            if group is None or split_queue_subject(user_subject(stored)) is not None:
                continue
            leaving = group.leaving(consumer, seen)
            if leaving is None:
                continue
            release, handed, unseen = leaving
            count, end = give_back(core, group, release, handed, unseen, "left")
            released += count
            log.info(
                "consumer %s of group %s on %s left: %d unacked messages go back to the group (%d never seen)",
                consumer,
                key,
                stored,
                count,
                len(unseen),
            )
        if end:
            await core.store.durable(end)
        return {"released": released}

    async def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        now = self.core.clock()
        for item in field(body, "consumers", list):
            if not (isinstance(item, list | tuple) and len(item) == 3 and all(isinstance(x, str) for x in item)):
                raise bad("each heartbeat must be [subject, group, consumer]")
            group = self.core.state.group(item[0], item[1])
            if group is not None:
                group.heartbeat(item[2], now)
        return {}
