"""Liveness: is this worker consuming? Celery's worst trap is a worker that stops consuming after a
reconnect while its process looks alive. Here the worker is unhealthy when there is work and it has
made no progress:

- it holds messages, or its brokers report a backlog for its groups, and no message has finished
  (acked, nacked, skipped) for `timeout_s`; or
- a consumer could not subscribe or pull for `timeout_s` (the brokers or meta server are away or
  refuse it); or a pull loop died.

A worker with nothing to do is healthy however long it waits. Slow handlers count as no progress
once they run past the timeout with work waiting: set `--liveness-timeout` above the longest
handler (or use `time_limit`). `Liveness` decides without I/O; `BacklogProbe` asks the brokers
(BROKER_STATS) for the backlog of each consumer's group.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Iterable

from qmq.client import Client, ClientError
from qmq.client.pool import ConnectionPool
from qmq.protocol.codes import RequestCode

log = logging.getLogger("qmq.worker")

DEFAULT_TIMEOUT_S = 60.0
STATS_TIMEOUT_S = 5.0


class Liveness:
    def __init__(self, timeout_s: float, now: float) -> None:
        self.timeout_s = timeout_s
        self.last_progress = now
        self.healthy = True
        self.reason = "ok"
        self._lock = threading.Lock()

    def progress(self, now: float) -> None:
        self.last_progress = now  # a float store: atomic, no lock needed on this hot path

    def check(self, now: float, held: int, backlog: int | None, problems: Iterable[tuple[str, float]]) -> bool:
        """Decide, from what the worker holds, the brokers' backlog (None: unknown) and the consumers'
        problems (text, monotonic time since when); the verdict is kept in `healthy` and `reason`."""
        reasons = [f"{text} (for {now - since:.0f} s)" for text, since in problems if now - since >= self.timeout_s]
        idle_s = now - self.last_progress
        if (held > 0 or (backlog or 0) > 0) and idle_s >= self.timeout_s:
            reasons.append(
                f"no message finished for {idle_s:.0f} s while {held} are held here and "
                f"{'an unknown number' if backlog is None else backlog} wait at the brokers"
            )
        if held == 0 and not backlog:
            self.last_progress = now  # nothing to do is not a stall: start counting when work appears
        with self._lock:
            self.healthy = not reasons
            self.reason = "; ".join(reasons) or "ok"
        return self.healthy


def broadcast_group_key(group: str, consumer: str) -> str:
    """The broker's name for a broadcast consumer's own position (docs/broker.md)."""
    return f"{group}.bc-{hashlib.sha1(consumer.encode()).hexdigest()[:12]}"


class BacklogProbe:
    """Messages waiting at the brokers for the given (subject, group key) pairs, from BROKER_STATS."""

    def __init__(self, client: Client, token: str | None) -> None:
        self.client = client
        self._pool = ConnectionPool(client_id="qmq-worker-liveness", token=token)
        self._refresh = False  # a broker could not be asked: its group's master may have moved

    def backlog(self, wanted: set[tuple[str, str]]) -> int | None:
        """The total backlog, or None when a broker could not be asked (the next call then asks the
        meta server for the routes again, rather than the same address until its route expires)."""
        total = 0
        refresh, self._refresh = self._refresh, False
        for address in self._addresses({subject for subject, _ in wanted}, refresh):
            try:
                stats = self._pool.request(address, RequestCode.BROKER_STATS, {}, STATS_TIMEOUT_S)
            except Exception as exc:
                log.debug("no stats from %s: %s", address, exc)
                self._refresh = True
                return None
            total += sum(
                int(g.get("backlog", 0))
                for g in stats.get("groups", ())
                if (g.get("subject"), g.get("group")) in wanted
            )
        return total

    def _addresses(self, subjects: set[str], refresh: bool) -> set[str]:
        addresses: set[str] = set()
        for subject in subjects:
            try:
                route = self.client.route(subject, refresh=refresh)
            except ClientError:
                continue
            addresses.update(group.addresses[0] for group in route.groups if group.addresses)
        return addresses

    def close(self) -> None:
        self._pool.close()
