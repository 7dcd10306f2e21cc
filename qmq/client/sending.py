"""Sending: the send loop, and the choices it makes without I/O.

`send` is the loop behind `Client.send` and `AsyncClient.send` (a generator of steps, see
`qmq.client.steps`): a `SendJob` spreads one call's messages over the writable groups of each
subject's route, batches them, merges the broker's per-message replies into `SendResult`s and says
which messages to offer again, and where; `GroupHealth` remembers groups that just failed, so that
the next messages go elsewhere first. `cancel` asks every delay server to drop delayed messages.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qmq.client.errors import ClientClosed, ClientError, ConnectFailed, InvalidMessage, MetaUnreachable, error_name
from qmq.client.messages import OutgoingMessage, SendResult, now_ms
from qmq.client.routes import Route, RouteBook, RouteGroup, with_epoch
from qmq.client.steps import Call, Calls, Sleep, Steps
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError, RemoteError
from qmq.protocol.limits import MAX_FRAME_BYTES

log = logging.getLogger("qmq.client")

DEFAULT_BATCH_SIZE = 64  # messages in one BROKER_SEND
MAX_BATCH_BYTES = MAX_FRAME_BYTES // 2  # payload bytes in one BROKER_SEND, well under a frame
SEND_ATTEMPTS = 3  # groups a message is offered to at least, before its send is reported as failed...
# ...and, while a message is younger than this, it is offered again and again (a failover takes 7-8 s
# with the defaults, docs/replication.md); its send is reported as failed once both ran out. Kafka's
# delivery.timeout.ms.
DELIVERY_TIMEOUT_S = 30.0
RETRY_DELAY_S = 0.2  # before offering a message again to a group that already failed it, doubling...
RETRY_MAX_DELAY_S = 1.0  # ...up to this
SUSPECT_FOR_S = 5.0  # a group that just failed a send is chosen last for this long
SEND_TIMEOUT_S = 10.0  # wait for one BROKER_SEND reply
# A send that failed with one of these may work on another group (or later); any other is final.
# NOT_MASTER: the group's master moved (a failover); the route is asked for again.
RETRIABLE_SEND_CODES = frozenset({ErrorCode.UNAVAILABLE, ErrorCode.READ_ONLY, ErrorCode.TIMEOUT, ErrorCode.NOT_MASTER})
CANCEL_TIMEOUT_S = 10.0  # wait for one DELAY_CANCEL reply
CANCEL_OUTCOMES = ("cancelled", "too_late", "unknown")  # best first


# ---- choosing groups -------------------------------------------------------------------------------


class GroupHealth:
    """Groups that failed a request lately, so that the next messages go elsewhere first (the meta
    server notices a dead broker only after its heartbeat timeout). Callers pass the clock, and hold
    `lock` where threads share one (the send loop holds it around a plan and around each report)."""

    def __init__(self, suspect_for_s: float = SUSPECT_FOR_S) -> None:
        self.suspect_for_s = suspect_for_s
        self.lock = threading.Lock()
        self._failed_at: dict[str, float] = {}

    def failed(self, group: str, now: float) -> None:
        self._failed_at[group] = now

    def succeeded(self, group: str) -> None:
        self._failed_at.pop(group, None)

    def suspect(self, group: str, now: float) -> bool:
        failed_at = self._failed_at.get(group)
        return failed_at is not None and now - failed_at < self.suspect_for_s


def sole_group(route: Route | None, health: GroupHealth | None = None, now: float = 0.0) -> RouteGroup | None:
    """The group `choose_group` gives every message of `route` not tried yet when there is no choice:
    the route's one writable group, unless it failed lately. None when there is a choice to make."""
    if route is None:
        return None
    writable = route.writable_groups
    if len(writable) == 1 and (health is None or not health.suspect(writable[0].name, now)):
        return writable[0]
    return None


def choose_group(
    route: Route, message_id: str, *, tried: Sequence[str] = (), health: GroupHealth | None = None, now: float = 0.0
) -> tuple[RouteGroup | None, bool]:
    """The group to offer a message to, and whether it is one the message already failed on.

    Writable groups (available, not read-only) only; those the message has not been tried on come
    first, then groups that have not failed lately; among equals the message id picks, so messages
    spread evenly over the groups and a retry moves to the next group of the route."""
    writable = route.writable_groups
    if not writable:
        return None, False
    if not tried and (sole := sole_group(route, health, now)) is not None:
        return sole, False
    untried = [g for g in writable if g.name not in tried]
    candidates, again = (untried, False) if untried else (list(writable), True)
    if health is not None:
        healthy = [g for g in candidates if not health.suspect(g.name, now)]
        candidates = healthy or candidates
    return candidates[zlib.crc32(message_id.encode()) % len(candidates)], again


# ---- one send call ---------------------------------------------------------------------------------


@dataclass
class SendBatch:
    """One BROKER_SEND (or DELAY_SEND to a delay server): `indices` are the positions of its
    messages in the job."""

    group: str
    addresses: tuple[str, ...]
    indices: list[int]
    body: dict[str, Any]
    code: int = RequestCode.BROKER_SEND


def classify_send_error(exc: BaseException) -> tuple[bool, int, str]:
    """(worth trying elsewhere, error code, text) for an exception from a BROKER_SEND request."""
    if isinstance(exc, ClientClosed):  # nothing more goes through this client: no use waiting
        return False, ErrorCode.UNAVAILABLE, str(exc)
    if isinstance(exc, RemoteError):
        return exc.code in RETRIABLE_SEND_CODES, exc.code, str(exc)
    if isinstance(exc, ProtocolError):  # refused by our own connection, e.g. a frame over the limit
        return False, exc.code, str(exc)
    if isinstance(exc, ConnectFailed) and exc.tls_refused:  # like a wrong token: the same on every try
        return False, ErrorCode.UNAVAILABLE, f"{exc} (a TLS setting to fix: --tls-ca, $QMQ_TLS_CA; not tried again)"
    if isinstance(exc, TimeoutError):
        return True, ErrorCode.TIMEOUT, str(exc) or "timed out"
    if isinstance(exc, OSError):  # ConnectionError included
        return True, ErrorCode.UNAVAILABLE, str(exc) or type(exc).__name__
    return False, ErrorCode.INTERNAL, repr(exc)


class SendJob:
    """The state of one `send(messages)` call. The send loop (`send`) fetches routes for
    `pending_routes()`, `plan()`s batches, sends them, reports each with `on_reply` or `on_error`,
    until `done`; then `results()`. Messages a broker would reject are answered at once."""

    def __init__(
        self,
        messages: Sequence[OutgoingMessage],
        *,
        batch_size: int = DEFAULT_BATCH_SIZE,
        max_attempts: int = SEND_ATTEMPTS,
        max_batch_bytes: int = MAX_BATCH_BYTES,
        delivery_timeout_s: float = 0.0,
        started: float = 0.0,
        routes_change: bool = True,
    ) -> None:
        """For `delivery_timeout_s` from `started` (the clock `plan` is given) a message that failed
        in a way worth trying again is offered again after its attempts ran out, and one with no
        writable group waits for one to appear (`waiting`) unless its routes never change
        (`routes_change` False: brokers given directly); 0: `max_attempts` decides."""
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        self.batch_size = batch_size
        self.max_attempts = max_attempts
        self.max_batch_bytes = max_batch_bytes
        self.delivery_timeout_s = delivery_timeout_s
        self.deadline = started + delivery_timeout_s if delivery_timeout_s > 0 else None
        self.routes_change = routes_change
        self.waiting: set[str] = set()  # set by plan(): route subjects whose messages wait for a group
        self.rounds_waited = 0  # rounds in a row that ended with messages waiting for a group
        self.messages = list(messages)
        self.wires: list[dict[str, Any] | None] = []
        self._results: list[SendResult | None] = []
        self._tried: list[list[str]] = [[] for _ in self.messages]
        self._last_error: list[tuple[int, str] | None] = [None] * len(self.messages)
        self.retry_delay_s = 0.0  # set by plan(): wait this long before sending its batches
        self.delayed: list[bool] = []  # goes to a delay server (deliver_at in the future)
        self._unsettled = 0  # messages without a result yet
        now = now_ms()
        for message in self.messages:
            deliver_at = getattr(message, "deliver_at", None)
            self.delayed.append(deliver_at is not None and deliver_at > now)
            try:
                self.wires.append(message.to_wire())  # subjects checked once per process (messages.py)
                if self.delayed[-1]:
                    self.wires[-1]["deliver_at"] = deliver_at
                self._results.append(None)
                self._unsettled += 1
            except InvalidMessage as exc:
                self.wires.append(None)
                self._results.append(self._failure(message, exc.code, f"{error_name(exc.code)}: {exc}"))

    @property
    def done(self) -> bool:
        return not self._unsettled

    def results(self) -> list[SendResult]:
        assert self.done, "the send job still has messages to send"
        return [r for r in self._results if r is not None]

    def pending_routes(self) -> dict[str, bool]:
        """The subjects whose routes the pending messages need (see `route_subject`), each with
        whether every one of its pending messages goes to a delay server."""
        routes: dict[str, bool] = {}
        for i in self._pending():
            subject = self.route_subject(i)
            routes[subject] = routes.get(subject, True) and self.delayed[i]
        return routes

    def route_subject(self, i: int) -> str:
        """The subject whose route message `i` follows: its own, or for an ordered message its
        queue's (`subject#queue`, whose route is the one group holding that queue)."""
        wire = self.wires[i]
        return wire["subject"] if wire is not None else self.messages[i].subject

    def fail_subject(self, subject: str, code: int, text: str, now: float = 0.0, *, final: bool = False) -> None:
        """The route of `subject` cannot be had: its pending messages wait for it until the deadline
        (`waiting`), or fail with this error (at once when `final`)."""
        for i in self._pending():
            if self.route_subject(i) == subject:
                if not final and self._may_wait(now):
                    self._last_error[i] = (code, text)
                    self.waiting.add(subject)
                else:
                    waited = not final and self.deadline is not None
                    self._finish(i, self._failure(self.messages[i], code, self._gave_up(i, text, waited)))

    def plan(self, routes: Mapping[str, Route], health: GroupHealth | None = None, now: float = 0.0) -> list[SendBatch]:
        """The batches for the next round: each pending message offered to one group. Messages with
        no writable group left, or out of attempts, fail here with the last error they met."""
        by_group: dict[tuple[bool, str, str | None], tuple[RouteGroup, list[int]]] = {}
        self.retry_delay_s = 0.0
        may_wait = self._may_wait(now)
        queue_room: dict[str, tuple[int, int]] = {}  # an ordered queue's messages in this round, bytes
        # (route subject, delayed) -> its route, and the group every untried message goes to when
        # there is no choice to make (`sole_group`): decided once per route, not once per message.
        chosen: dict[tuple[str, bool], tuple[Route | None, RouteGroup | None]] = {}
        for i in self._pending():
            message = self.messages[i]
            subject = self.route_subject(i)
            queue = subject if getattr(message, "order_key", None) is not None else None
            if queue is not None:
                # An ordered queue's messages go one batch per round, so that no two requests of one
                # queue are in flight at once (they could be stored in either order).
                count, size = queue_room.get(queue, (0, 0))
                wire = self.wires[i]
                assert wire is not None
                if count and (count >= self.batch_size or size + len(wire["payload"]) > self.max_batch_bytes):
                    continue
                queue_room[queue] = (count + 1, size + len(wire["payload"]))
            delayed = self.delayed[i]
            tried = self._tried[i]
            if len(tried) >= self.max_attempts and not may_wait:
                code, text = self._last_error[i] or (ErrorCode.UNAVAILABLE, "no attempt left")
                waited = self.deadline is not None  # and it passed
                self._finish(i, self._failure(message, code, self._gave_up(i, f"last: {text}", waited)))
                continue
            found = chosen.get((subject, delayed))
            if found is None:
                route = routes.get(subject)
                if delayed and route is not None:
                    route = route.delay_route
                found = chosen[(subject, delayed)] = (route, sole_group(route, health, now))
            route, sole = found
            if sole is not None and not tried:
                group, again = sole, False
            elif route is not None:
                group, again = choose_group(route, message.id, tried=tried, health=health, now=now)
            else:
                group, again = None, False
            if group is None:
                text = (
                    "no delay server is available for delayed messages"
                    if delayed
                    else f"no writable broker group carries subject {message.subject!r}"
                )
                if may_wait and self.routes_change:  # a broker may join, a replica take office: asked again
                    self.waiting.add(subject)
                    continue
                if self._last_error[i] is not None:
                    text += f" (last error: {self._last_error[i][1]})"
                waited = self.deadline is not None and not may_wait
                self._finish(i, self._failure(message, ErrorCode.UNAVAILABLE, self._gave_up(i, text, waited)))
                continue
            if again:
                assert route is not None
                retries = len(tried) - len(route.writable_groups) + 1
                self.retry_delay_s = max(self.retry_delay_s, self._backoff_s(retries))
            tried.append(group.name)
            by_group.setdefault((delayed, group.name, queue), (group, []))[1].append(i)
        batches = []
        for (delayed, _name, _queue), (group, indices) in by_group.items():
            batch: list[int] = []
            size = 0
            for i in indices:
                wire = self.wires[i]
                assert wire is not None
                if batch and (len(batch) >= self.batch_size or size + len(wire["payload"]) > self.max_batch_bytes):
                    batches.append(self._batch(group, batch, delayed))
                    batch, size = [], 0
                batch.append(i)
                size += len(wire["payload"])
            if batch:
                batches.append(self._batch(group, batch, delayed))
        self.rounds_waited = self.rounds_waited + 1 if self.waiting else 0
        if self.waiting and not batches:
            self.retry_delay_s = self._backoff_s(self.rounds_waited)
        if self.deadline is not None and self.retry_delay_s:  # no sleep past the deadline
            self.retry_delay_s = max(min(self.retry_delay_s, self.deadline - now), 0.0)
        return batches

    def on_reply(self, batch: SendBatch, reply: dict[str, Any]) -> None:
        """Merge a BROKER_SEND reply: `rejected` lists [index in the batch, code, message]; every
        other message of the batch was stored."""
        rejected: dict[int, tuple[int, str]] = {}
        for item in reply.get("rejected") or ():
            index, code, text = item[0], int(item[1]), str(item[2])
            rejected[int(index)] = (code, text)
        for position, i in enumerate(batch.indices):
            message = self.messages[i]
            if position not in rejected:
                self._finish(i, SendResult.stored(message.id, message.subject, batch.group))
                continue
            code, text = rejected[position]
            text = f"{error_name(code)}: {text}"
            if code in RETRIABLE_SEND_CODES:
                self._last_error[i] = (code, f"group {batch.group}: {text}")
            else:
                self._finish(i, self._failure(message, code, text))

    def on_error(self, batch: SendBatch, exc: BaseException) -> bool:
        """The whole request failed. Returns whether its messages will be tried again (on another
        group when the route has one); if not, they failed with this error."""
        retriable, code, text = classify_send_error(exc)
        for i in batch.indices:
            if retriable:
                self._last_error[i] = (code, f"group {batch.group}: {text}")
            else:
                self._finish(i, self._failure(self.messages[i], code, text))
        return retriable

    def _may_wait(self, now: float) -> bool:
        return self.deadline is not None and now < self.deadline

    @staticmethod
    def _backoff_s(retries: int) -> float:
        """The pause before the `retries`-th offer again to a group that failed, or the `retries`-th
        look for a group (1 for the first)."""
        return min(RETRY_DELAY_S * 2 ** min(max(retries - 1, 0), 10), RETRY_MAX_DELAY_S)

    def _gave_up(self, i: int, text: str, waited: bool) -> str:
        """The error of a message given up on: the delivery timeout when it was `waited` out, its
        attempts (when it had any), then `text`."""
        tried = self._tried[i]
        names = ", ".join(dict.fromkeys(tried))
        if waited:
            attempts = f" ({len(tried)} attempts, on {names})" if tried else ""
            return f"not stored within {self.delivery_timeout_s:g} s{attempts}; {text}"
        return f"not stored after {len(tried)} attempts (on {names}); {text}" if tried else text

    def _finish(self, i: int, result: SendResult) -> None:
        if self._results[i] is None:
            self._unsettled -= 1
        self._results[i] = result

    def _pending(self) -> list[int]:
        return [i for i, r in enumerate(self._results) if r is None]

    def _batch(self, group: RouteGroup, indices: list[int], delayed: bool = False) -> SendBatch:
        return SendBatch(
            group.name,
            group.addresses,
            indices,
            with_epoch({"messages": [self.wires[i] for i in indices]}, group),
            RequestCode.DELAY_SEND if delayed else RequestCode.BROKER_SEND,
        )

    @staticmethod
    def _failure(message: OutgoingMessage, code: int, text: str) -> SendResult:
        return SendResult(message.id, message.subject, False, error_code=int(code), error=text)


# ---- the loops ----------------------------------------------------------------------------------------


def send(
    routes: RouteBook,
    health: GroupHealth,
    messages: Iterable[OutgoingMessage],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    timeout_s: float = SEND_TIMEOUT_S,
    delivery_timeout_s: float = DELIVERY_TIMEOUT_S,
) -> Steps[list[SendResult]]:
    """Send messages; one result per message, in order, never an exception for a message that could
    not be sent. The batches of a round go out together; a message whose group failed is offered to
    another group of its route (the same id), its route asked for again; for `delivery_timeout_s`
    (plus the request in flight then) it is offered again, and waits for a writable group."""
    job = SendJob(
        list(messages),
        batch_size=batch_size,
        delivery_timeout_s=delivery_timeout_s,
        started=time.monotonic(),
        routes_change=routes.meta is not None,
    )
    refresh: set[str] = set()
    while not job.done:
        refresh |= job.waiting  # no writable group last round: ask the meta server again
        job.waiting = set()
        routes_now: dict[str, Route] = {}
        for subject, delayed_only in job.pending_routes().items():
            try:
                routes_now[subject] = yield from routes.lookup(
                    subject, refresh=subject in refresh, delayed_only=delayed_only
                )
            except MetaUnreachable as exc:  # waited out, unless refused (a wrong token, TLS)
                final = exc.tls_refused or (exc.code is not None and exc.code not in RETRIABLE_SEND_CODES)
                job.fail_subject(subject, exc.code or ErrorCode.UNAVAILABLE, str(exc), time.monotonic(), final=final)
            except ClientClosed as exc:
                job.fail_subject(subject, ErrorCode.UNAVAILABLE, str(exc), final=True)
        with health.lock:
            batches = job.plan(routes_now, health, time.monotonic())
        refresh = set()
        if job.rounds_waited == 1:
            log.warning(
                "no writable broker group known for %s now; asking again until the send's delivery timeout (%g s)",
                ", ".join(sorted(job.waiting)),
                delivery_timeout_s,
            )
        if not batches:
            if job.waiting:
                yield Sleep(job.retry_delay_s)
            continue
        if job.retry_delay_s:
            yield Sleep(job.retry_delay_s)  # every group left already failed these messages once
        outcomes = yield Calls([Call(b.addresses[0], b.code, b.body, timeout_s) for b in batches])
        for batch, outcome in zip(batches, outcomes, strict=True):
            if isinstance(outcome, BaseException):
                if job.on_error(batch, outcome):
                    log.warning(
                        "send to broker group %s failed (%s); offering its messages again", batch.group, outcome
                    )
                    with health.lock:
                        health.failed(batch.group, time.monotonic())
                    refresh |= {job.route_subject(i) for i in batch.indices}
            else:
                job.on_reply(batch, outcome)
                with health.lock:
                    health.succeeded(batch.group)
        routes.invalidate(refresh)
    return job.results()


def cancel(routes: RouteBook, message_ids: Iterable[str]) -> Steps[dict[str, str]]:
    """Cancel delayed messages by id: every delay server is asked (the message is on one of them);
    see `merge_cancel_outcomes`. Raises `ClientError` when a delay server could not be asked."""
    ids = list(message_ids)
    if not ids:
        return {}
    addresses = yield from routes.delay_server_addresses()
    replies = yield Calls([Call(a, RequestCode.DELAY_CANCEL, {"ids": ids}, CANCEL_TIMEOUT_S) for a in addresses])
    for address, reply in zip(addresses, replies, strict=True):
        if isinstance(reply, RemoteError | OSError):
            raise ClientError(
                f"cancel not confirmed by delay server {address} ({reply}); the message may be there: "
                "cancel again (cancelling twice is harmless)"
            )
        if isinstance(reply, BaseException):
            raise reply
    return merge_cancel_outcomes(ids, replies)


def merge_cancel_outcomes(ids: Sequence[str], replies: Sequence[dict[str, Any]]) -> dict[str, str]:
    """One outcome per id from every delay server's DELAY_CANCEL reply: the message is on one of
    them, so the best outcome wins ("cancelled": it will never be delivered; "too_late": it was due
    already and was or is being delivered; "unknown": no delay server knows it)."""
    best = dict.fromkeys(ids, len(CANCEL_OUTCOMES) - 1)
    for reply in replies:
        for message_id, outcome in zip(ids, reply.get("outcomes") or (), strict=False):
            if outcome in CANCEL_OUTCOMES:
                best[message_id] = min(best[message_id], CANCEL_OUTCOMES.index(outcome))
    return {message_id: CANCEL_OUTCOMES[rank] for message_id, rank in best.items()}
