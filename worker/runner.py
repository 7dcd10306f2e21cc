"""`Worker`: what `qmq worker` runs. It wires the parts together and owns the order of things:

    feeders (one per consumer: subscribe, pull within capacity) -> pool (run the chain of steps and
    the handler) -> settle (ack, or nack for a retry or a dead letter) ; a supervisor thread flushes
    acks every half second, heartbeats, checks liveness, purges old idempotency records and carries
    out a warm shutdown; a cold shutdown is carried out by its own thread.

A message is acknowledged only after its handler returned and its transaction committed (late ack);
until then a crash leaves it to be delivered again.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from typing import Any

from qmq.client import Client, Delivery
from qmq.client.deliveries import PULL_REPLY_GRACE_S
from qmq.protocol.limits import consumer_id_from
from worker.app import App
from worker.capacity import Capacity
from worker.consumer import Consumer
from worker.database import MissingTables, check_tables
from worker.feeder import PULL_WAIT_S, SUBSCRIBE_RETRY_MAX_S, SUBSCRIBE_RETRY_S, Feeder
from worker.hooks import log as hooks_log
from worker.http import serve
from worker.liveness import DEFAULT_TIMEOUT_S, BacklogProbe, Liveness, broadcast_group_key
from worker.message import Message
from worker.metrics import ConsumerMetrics, WorkerMetrics
from worker.ordered_feeder import OrderedFeeder
from worker.outcome import Kind, Outcome
from worker.pipeline import outer_chain
from worker.pool import Job, Pool, ProcessPool, SoloPool, ThreadPool
from worker.shutdown import Shutdown
from worker.steps.idempotency import purge_consumed
from worker.steps.metrics import metrics_step
from worker.steps.step import Call, Next

log = logging.getLogger("qmq.worker")

DEFAULT_PREFETCH_MULTIPLIER = 16  # Celery has 4; see worker/capacity.py
DEFAULT_THREADS = 8  # Dramatiq's
DEFAULT_HOSTNAME = "qmq-%p@%h"
ACK_FLUSH_EVERY_S = 0.5  # acks wait at most this long (plus a round trip) once a handler finished
HEARTBEAT_EVERY_S = 10.0  # the broker gives a silent consumer's messages away after 60 s by default
TICK_S = 0.1  # the supervisor's loop
PURGE_FIRST_AFTER_S = 60.0  # the first purge of old idempotency records after start...
PURGE_EVERY_S = 3600.0  # ...then every hour
SWITCH_INTERVAL_S = 0.001  # GIL hand-over between threads (CPython's default 5 ms delays a woken pull reply)
COLD_FLUSH_S = 2.0  # a cold shutdown sends what is acknowledged for at most this long, then exits


@dataclass
class WorkerOptions:
    concurrency: int | None = None  # threads: 8; processes: the CPU count; solo: 1
    pool: str = "threads"
    subjects: Sequence[str] = ()  # -Q: serve only these subjects' consumers
    hostname: str = DEFAULT_HOSTNAME
    prefetch_multiplier: int = DEFAULT_PREFETCH_MULTIPLIER
    meta: str | None = None
    brokers: Sequence[str] = ()
    token: str | None = None
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    liveness_timeout_s: float = DEFAULT_TIMEOUT_S
    app_spec: str | None = None  # how a pool process imports the app (-P processes)
    log_level: str = "WARNING"
    # Where a consumer group new to a broker starts, for consumers that do not say (@app.consumer(start=)):
    # "earliest", so that nothing committed before the first worker ran is skipped; "latest" to opt out.
    start: str = "earliest"

    def resolved_concurrency(self) -> int:
        if self.pool == "solo":
            return 1
        if self.concurrency is not None:
            return self.concurrency
        return DEFAULT_THREADS if self.pool == "threads" else (os.cpu_count() or 1)


def expand_hostname(template: str) -> str:
    """Celery's node name: %h the host name, %n its first part, %d the rest, %p the process id; made
    fit for a consumer id (`qmq.protocol.limits.consumer_id_from`)."""
    host = socket.gethostname()
    name, _, domain = host.partition(".")
    expanded = template.replace("%h", host).replace("%n", name).replace("%d", domain).replace("%p", str(os.getpid()))
    return consumer_id_from(expanded)


class Worker:
    def __init__(
        self, app: App, options: WorkerOptions | None = None, on_ready: Callable[[Worker], None] | None = None
    ) -> None:
        self.app = app
        self.options = options = options or WorkerOptions()
        self.on_ready = on_ready
        self.consumers = select_consumers(app, options.subjects)
        self.concurrency = options.resolved_concurrency()
        self.hostname = expand_hostname(options.hostname)
        if options.pool not in ("threads", "processes", "solo"):
            raise ValueError(f"unknown pool {options.pool!r}: threads, processes or solo")
        if options.pool == "processes" and not options.app_spec:
            raise ValueError("the processes pool needs the app's import path (app_spec, as given to -A)")
        self.capacity = Capacity(self.concurrency, options.prefetch_multiplier, len(self.consumers))
        self.metrics = WorkerMetrics()
        self.liveness = Liveness(options.liveness_timeout_s, time.monotonic())
        self.shutdown = Shutdown()
        self.client: Client | None = None
        self.feeders: list[Feeder] = []
        self.pool: Pool = self._make_pool()
        self.http: ThreadingHTTPServer | None = None
        self._bound: dict[int, ConsumerMetrics] = {
            id(c): self.metrics.consumer(c.subject, c.group) for c in self.consumers
        }
        self._done = threading.Event()
        self._exit_code = 0
        self._running: dict[int, dict[str, Any]] = {}  # job -> the message it runs, for the heartbeat report
        self._running_lock = threading.Lock()

    # ---- running ---------------------------------------------------------------------------------

    def run(self) -> int:
        """Consume until a warm shutdown (returns 0); a cold shutdown ends the process from its own thread.
        Call from the main thread (signal handlers are installed here)."""
        o = self.options
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        if o.pool == "threads":
            self.app.pool_size = max(self.app.pool_size, self.concurrency)
        self.shutdown.install()
        if not self._wait_for_tables():
            return 0
        self.client = self.app.client(o.meta, o.brokers, o.token, client_id=self.hostname)
        self.feeders = [
            (OrderedFeeder if c.ordered else Feeder)(
                c, self.client, self.hostname, self.capacity, self._dispatch, o.start
            )
            for c in self.consumers
        ]
        threading.Thread(target=self._cold_watch, name="qmq-cold-shutdown", daemon=True).start()
        if o.metrics_port is not None:
            self.http = serve(o.metrics_host, o.metrics_port, self.metrics.registry, self.health)
        self.pool.start()
        for feeder in self.feeders:
            feeder.start()
        supervisor = threading.Thread(target=self._supervise, name="qmq-supervisor", daemon=True)
        supervisor.start()
        if isinstance(self.pool, SoloPool):
            self.pool.run_here()
        while not self._done.wait(TICK_S):
            pass
        if self._exit_code == 0:
            log.warning("warm shutdown complete")
        return self._exit_code

    def _wait_for_tables(self) -> bool:
        """Check that the database has the tables the consumers need before any of them subscribes:
        MissingTables (a clear error, the worker does not start) if not; an unreachable database is
        waited for. False if a shutdown came first."""
        delay = SUBSCRIBE_RETRY_S
        needs_consumed = any(c.idempotent is True for c in self.consumers)
        while True:
            try:
                check_tables(self.app.database, needs_consumed)
                return True
            except MissingTables:
                raise
            except Exception as exc:
                log.warning("cannot check the app's database (%s); trying again in %.0f s", exc, delay)
            if self.shutdown.warm.wait(delay):
                return False
            delay = min(delay * 2, SUBSCRIBE_RETRY_MAX_S)

    def health(self) -> tuple[bool, str]:
        return self.liveness.healthy, self.liveness.reason

    @property
    def metrics_port(self) -> int | None:
        return self.http.server_port if self.http is not None else None

    def _make_pool(self) -> Pool:
        o = self.options
        if o.pool == "solo":
            return SoloPool(self._handle, self._wrap)
        if o.pool == "processes":
            assert o.app_spec is not None
            return ProcessPool(self.concurrency, self._handle, self._wrap, o.app_spec, o.log_level)
        return ThreadPool(self.concurrency, self._handle, self._wrap)

    # ---- one message -------------------------------------------------------------------------------

    def _dispatch(self, feeder: Feeder, deliveries: list[Delivery]) -> None:
        """From a feeder: deliveries pulled, to the pool."""
        bound = self._bound[id(feeder.consumer)]
        bound.received.inc(len(deliveries))
        bound.in_flight.inc(len(deliveries))
        self.pool.submit(feeder, deliveries)

    def _wrap(self, consumer: Consumer, inner: Next) -> Next:
        return outer_chain([metrics_step(self.metrics)], inner)

    def _handle(self, job: Job, chain: Next) -> None:
        """In a pool thread: run the chain, then settle the delivery with the broker."""
        feeder, delivery = job.feeder, job.delivery
        consumer: Consumer = feeder.consumer
        if consumer.ordered and not feeder.admit(delivery):  # its queue's lease is in doubt: it waits
            self._bound[id(consumer)].in_flight.dec()
            return
        self.capacity.started()
        running = {
            "id": delivery.id,
            "subject": delivery.subject,
            "group": consumer.group,
            "attempt": delivery.attempt,
            "started_at": int(time.time() * 1000),
        }
        with self._running_lock:
            self._running[id(job)] = running
        try:
            message = Message.from_delivery(delivery, consumer.group)
            try:
                outcome = chain(Call(message, consumer))
            except Exception as exc:  # a step outside the retry step failed
                log.exception("%s %s: a step failed", consumer.name, delivery.id)
                outcome = consumer.retry.decide(exc, delivery.attempt)
            try:
                if consumer.ordered:
                    feeder.settle(delivery, outcome)  # retried in place, its key waiting (worker/ordered_feeder.py)
                else:
                    settle(feeder, delivery, outcome)
            except Exception:  # the client does not raise for a lost broker; anything else is a bug to see
                log.exception("%s %s: settling failed; the broker will deliver it again", consumer.name, delivery.id)
        finally:
            with self._running_lock:
                self._running.pop(id(job), None)
            self.capacity.finished()
            self._bound[id(consumer)].in_flight.dec()
            self.liveness.progress(time.monotonic())

    # ---- the supervisor: acks, heartbeats, liveness, purge, warm shutdown ----------------------------

    def _supervise(self) -> None:
        """The supervisor thread. A failure in one of its chores is logged and the chore tried again
        next time: this thread stopping would stop acknowledgements and the warm shutdown."""
        probe = BacklogProbe(self.client, self.options.token or self.app.token) if self.client else None
        chores = Chores(time.monotonic(), max(0.5, min(5.0, self.options.liveness_timeout_s / 4)))
        while not self.shutdown.warm.wait(TICK_S):
            try:
                self._chores(chores, probe, time.monotonic())
            except Exception:
                log.exception("the worker's supervisor failed a chore; carrying on")
        try:
            if probe is not None:
                probe.close()
            self._warm_shutdown()
        except BaseException:
            log.exception("the warm shutdown failed")
            self._exit_code = 1
            self.pool.close()  # let a solo pool's main thread return
        finally:
            self._done.set()

    def _chores(self, chores: Chores, probe: BacklogProbe | None, now: float) -> None:
        if not chores.ready and all(f.subscribed.is_set() for f in self.feeders):
            chores.ready = True
            chores.next_beat = now  # the brokers learn at once what this worker is (qmq admin inspect)
            self._ready()
        if now >= chores.next_flush:
            chores.next_flush = now + ACK_FLUSH_EVERY_S
            self._flush()
        if now >= chores.next_beat:
            chores.next_beat = now + HEARTBEAT_EVERY_S
            report = self.report()
            for subscription in self._subscriptions():
                subscription.heartbeat(report)
        if now >= chores.next_check and probe is not None:
            chores.next_check = now + chores.check_every_s
            self._check_liveness(probe, now)
        if now >= chores.next_purge:
            chores.next_purge = now + PURGE_EVERY_S
            self._start_purge()

    def _ready(self) -> None:
        log.info(
            "worker %s ready: %d consumers, pool %s, concurrency %d",
            self.hostname,
            len(self.feeders),
            self.options.pool,
            self.concurrency,
        )
        self.app.hooks.fire("worker_ready", self)
        if self.on_ready is not None:
            try:
                self.on_ready(self)
            except Exception:
                hooks_log.exception("on_ready failed")

    def report(self) -> dict[str, Any]:
        """What the heartbeats tell the brokers about this worker (`qmq admin inspect`, the console's
        workers page, as `celery inspect active`): who it is, how much it may run, what it runs."""
        with self._running_lock:
            running = sorted(self._running.values(), key=lambda r: r["started_at"])
        return {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "app": self.app.name,
            "pool": self.options.pool,
            "concurrency": self.concurrency,
            "held": self.capacity.held,
            "running": running,
            "consumers": [{"subject": c.subject, "group": c.group} for c in self.consumers],
        }

    def _subscriptions(self) -> list:
        return [f.subscription for f in self.feeders if f.subscription is not None]

    def _flush(self) -> None:
        for subscription in self._subscriptions():
            subscription.flush()

    def _check_liveness(self, probe: BacklogProbe, now: float) -> None:
        wanted = set()
        for feeder in self.feeders:
            c = feeder.consumer
            wanted.add((c.subject, broadcast_group_key(c.group, feeder.consumer_id) if c.broadcast else c.group))
        backlog = probe.backlog(wanted)
        problems = [
            (f.problem or "pull loop stopped", f.problem_since or now)
            for f in self.feeders
            if f.problem is not None or not f.alive
        ]
        was = self.liveness.healthy
        healthy = self.liveness.check(time.monotonic(), self.capacity.held, backlog, problems)
        self.metrics.healthy.set(1 if healthy else 0)
        self.metrics.last_progress.set(time.time() - (time.monotonic() - self.liveness.last_progress))
        if was and not healthy:
            log.error("worker unhealthy: %s", self.liveness.reason)
        elif healthy and not was:
            log.warning("worker healthy again")

    def _start_purge(self) -> None:
        if not any(c.idempotent is True for c in self.consumers):
            return

        def purge() -> None:
            try:
                count = purge_consumed(self.app.engine, self.app.idempotency_window)
                if count:
                    log.info("purged %d idempotency records older than %s", count, self.app.idempotency_window)
            except Exception:
                log.exception("purging old idempotency records failed; trying again later")

        threading.Thread(target=purge, name="qmq-purge", daemon=True).start()

    def _warm_shutdown(self) -> None:
        log.warning(
            "warm shutdown: no more pulls; finishing %d messages held (Ctrl-C again or SIGQUIT for a cold shutdown)",
            self.capacity.held,
        )
        self.app.hooks.fire("worker_shutting_down", self, "warm")
        self.capacity.stop()
        for feeder in self.feeders:
            feeder.stop()
        deadline = time.monotonic() + PULL_WAIT_S + PULL_REPLY_GRACE_S
        for feeder in self.feeders:  # a pull in flight comes back within its wait; its messages are handled
            feeder.join(max(0.0, deadline - time.monotonic()))
        self.pool.close()
        while not self.pool.join(ACK_FLUSH_EVERY_S):
            self._flush()
        for subscription in self._subscriptions():
            subscription.close()  # flushes the last acks
        for feeder in self.feeders:
            if isinstance(feeder, OrderedFeeder):
                feeder.leave()  # the queues go to the other workers at once, not after their leases expire
        if self.client is not None:
            self.client.close()
        if self.http is not None:
            self.http.shutdown()

    def _cold_watch(self) -> None:
        self.shutdown.cold.wait()
        sig = self.shutdown.cold_signal
        log.warning(
            "cold shutdown (%s): stopping now; %d messages held are not acknowledged and will be delivered again",
            sig.name,
            self.capacity.held,
        )
        self.app.hooks.fire("worker_shutting_down", self, "cold")
        self.pool.kill()
        flusher = threading.Thread(target=self._flush, daemon=True)
        flusher.start()
        flusher.join(COLD_FLUSH_S)
        logging.shutdown()
        os._exit(128 + int(sig))


@dataclass
class Chores:
    """When the supervisor next does each of its chores (monotonic seconds)."""

    started: float
    check_every_s: float
    ready: bool = False

    def __post_init__(self) -> None:
        self.next_flush = self.started
        self.next_beat = self.started + HEARTBEAT_EVERY_S
        self.next_check = self.started
        self.next_purge = self.started + PURGE_FIRST_AFTER_S


def settle(feeder: Feeder, delivery: Delivery, outcome: Outcome) -> None:
    """Tell the broker how a delivery ended: ack, or nack for a retry after a delay or a dead letter."""
    subscription = feeder.subscription
    assert subscription is not None, "a delivery comes from a subscription"
    if outcome.kind in (Kind.ACK, Kind.DUPLICATE):
        subscription.ack(delivery)
    elif outcome.kind is Kind.RETRY:
        subscription.nack(
            delivery, outcome.delay_s, reason=outcome.reason, max_attempts=feeder.consumer.retry.max_attempts
        )
    else:
        subscription.nack(delivery, 0.0, dead=True, reason=outcome.reason)


def select_consumers(app: App, subjects: Sequence[str]) -> list[Consumer]:
    """The app's consumers of `subjects` (all when empty); ValueError naming what is missing."""
    if not app.consumers:
        raise ValueError(f"app {app.name!r} has no consumers: decorate handlers with @app.consumer(...)")
    if not subjects:
        return list(app.consumers)
    unknown = set(subjects) - {c.subject for c in app.consumers}
    if unknown:
        known = ", ".join(sorted({c.subject for c in app.consumers}))
        raise ValueError(f"no consumer in app {app.name!r} for {', '.join(sorted(unknown))} (it has: {known})")
    return [c for c in app.consumers if c.subject in subjects]
