"""`qmq.App`: the application object a worker serves, and its consumers (Celery's app and tasks).

    app = qmq.App("billing", meta="127.0.0.1:20880", db="postgresql://...")

    @app.consumer("order.created", group="billing", idempotent=True, max_retries=32)
    def on_order(message: qmq.Message, session) -> None:
        session.execute(...)            # committed with the idempotency record, then acked

With Django, `qmq.App("billing", using="default")`: the handler uses the ORM, and runs with its
idempotency record in one `transaction.atomic(using="default")` block.

Run it with `qmq worker -A module:app`. The app holds settings only: it connects to nothing until a
worker asks (the engine and the Redis client are made on first use, in the process that uses them,
so a pool process never shares a connection made by its parent).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy.engine import Engine

from qmq.client import Client
from qmq.client.deliveries import SubscribeOptions
from worker.consumer import Consumer, Idempotent
from worker.database import ConsumerDatabase, SQLAlchemyDatabase
from worker.hooks import Hooks
from worker.retry_policy import DEFAULT_BACKOFF_MAX_S, DEFAULT_BACKOFF_S, DEFAULT_MAX_RETRIES, RetryPolicy
from worker.steps.idempotency import DEFAULT_WINDOW
from worker.steps.step import Step

DEFAULT_REDIS_PREFIX = "qmq:"
POISON_CHOICES = ("dead-letter", "stop")


class App:
    """Settings, consumers, steps and hooks. `meta` (or `$QMQ_META`) or `brokers` say where the brokers
    are, as for `qmq.client.Client`; `db` (a URL) or `engine` is the database of the handlers'
    sessions and of SQL idempotency, or `using` a Django database alias; `redis` (a URL or a redis
    client) that of Redis idempotency."""

    def __init__(
        self,
        name: str,
        *,
        meta: str | None = None,
        brokers: Sequence[str] | None = None,
        token: str | None = None,
        db: str | None = None,
        engine: Engine | None = None,
        using: str | None = None,
        redis: Any = None,
        redis_prefix: str = DEFAULT_REDIS_PREFIX,
        idempotency_window: timedelta = DEFAULT_WINDOW,
    ) -> None:
        if sum(x is not None for x in (db or None, engine, using)) > 1:
            raise ValueError("give one of db (a URL), engine or (Django) using")
        self.name = name
        self.meta = meta
        self.brokers = tuple(brokers or ())
        self.token = token
        self.db_url = db
        self.using = using
        self.redis_prefix = redis_prefix
        self.idempotency_window = idempotency_window
        self.consumers: list[Consumer] = []
        self.steps: list[Step] = []
        self.hooks = Hooks()
        self.pool_size = 5  # the engine's pool; the worker raises it to its concurrency
        self._engine = engine
        self._redis = redis
        self._lock = threading.Lock()
        self._database: ConsumerDatabase | None = None

    # ---- declaring -------------------------------------------------------------------------------

    def consumer(
        self,
        subject: str,
        *,
        group: str | None = None,
        tags: Sequence[str] = (),
        match_all: bool = False,
        broadcast: bool = False,
        start: str | None = None,
        max_retries: int | None = DEFAULT_MAX_RETRIES,
        retry_backoff: float | bool = DEFAULT_BACKOFF_S,
        retry_backoff_max: float = DEFAULT_BACKOFF_MAX_S,
        retry_jitter: bool = True,
        autoretry_for: Sequence[type[BaseException]] = (Exception,),
        dont_autoretry_for: Sequence[type[BaseException]] = (),
        time_limit: float | None = None,
        idempotent: Idempotent = False,
        ordered: bool = False,
        on_poison: str = "dead-letter",
    ) -> Callable[[Callable], Callable]:
        """Register the decorated function as the handler of `subject` for consumer `group` (default:
        the app's name). It is called with the `qmq.Message`, and with `session=` (a SQLAlchemy
        Session in the message's transaction) when it has a `session` parameter. Returns the function
        unchanged. `ordered`: the messages of one order key are handled one at a time in outbox
        order, a failing one retried in place; after `max_retries`, `on_poison` says whether the key
        goes on past its dead letter ("dead-letter") or stops until it is re-driven ("stop";
        docs/ordering.md). See docs/worker.md for every option."""
        group = group or self.name
        options = (subject, group, "check", tuple(tags), match_all, broadcast, start or "earliest")
        SubscribeOptions(*options)  # ValueError if bad
        if retry_backoff is True:
            retry_backoff = DEFAULT_BACKOFF_S
        policy = RetryPolicy(
            max_retries,
            float(retry_backoff or 0),
            float(retry_backoff_max),
            retry_jitter,
            tuple(autoretry_for),
            tuple(dont_autoretry_for),
        )
        if time_limit is not None and not time_limit > 0:
            raise ValueError("time_limit must be a number of seconds > 0")
        if idempotent not in (False, True, "redis"):
            raise ValueError("idempotent must be False, True (SQL) or 'redis'")
        if idempotent is True and not self.has_database:
            raise ValueError(
                f"{subject}/{group}: idempotent=True needs the app's database (App(..., db=URL) or, Django, using=)"
            )
        if idempotent == "redis" and self._redis is None:
            raise ValueError(f"{subject}/{group}: idempotent='redis' needs App(..., redis=URL or client)")
        if broadcast and idempotent:
            raise ValueError("a broadcast consumer cannot be idempotent by group: every worker must run it")
        if on_poison not in POISON_CHOICES:
            raise ValueError(f"on_poison must be one of {', '.join(POISON_CHOICES)}, not {on_poison!r}")
        if ordered and (broadcast or tags):
            raise ValueError(
                f"{subject}/{group}: an ordered consumer takes every message of its queues: no broadcast or tags"
            )
        if any(c.subject == subject and c.group == group for c in self.consumers):
            raise ValueError(f"{subject} already has a consumer for group {group!r} in this app")

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            wants_session = "session" in inspect.signature(fn).parameters
            if wants_session and self.using is not None:
                raise ValueError(f"{fn.__qualname__} takes a session, but a Django app's handlers use the ORM")
            if wants_session and not self.has_database:
                raise ValueError(f"{fn.__qualname__} takes a session but the app has no database (db=URL)")
            self.consumers.append(
                Consumer(
                    self,
                    fn,
                    subject,
                    group,
                    tuple(tags),
                    match_all,
                    broadcast,
                    start,
                    policy,
                    time_limit,
                    idempotent,
                    wants_session,
                    ordered,
                    on_poison,
                )
            )
            return fn

        return register

    def add_step(self, step: Step) -> None:
        """Add a step around every handler of this app (inside retry, outside the transaction; see
        worker/steps/step.py)."""
        self.steps.append(step)

    def on(self, event: str) -> Callable[[Callable], Callable]:
        """Register the decorated function for a hook (worker/hooks.py lists them)."""
        self.hooks.check(event)

        def register(fn: Callable[..., Any]) -> Callable[..., Any]:
            self.hooks.add(event, fn)
            return fn

        return register

    # ---- connections, made on first use -------------------------------------------------------------

    @property
    def has_database(self) -> bool:
        return self.db_url is not None or self._engine is not None or self.using is not None

    @property
    def database(self) -> ConsumerDatabase:
        """Where handlers' transactions run (worker/database.py)."""
        with self._lock:
            if self._database is None:
                if self.using is not None:
                    from qmq.contrib.django.consumer import DjangoDatabase

                    self._database = DjangoDatabase(self.using)
                else:
                    self._database = SQLAlchemyDatabase(lambda: self.engine)
            return self._database

    @property
    def engine(self) -> Engine:
        if self.using is not None:
            return self.database.engine()
        with self._lock:
            if self._engine is None:
                if self.db_url is None:
                    raise RuntimeError(f"app {self.name!r} has no database: App(..., db=URL)")
                from qmq.db.engine import create_engine

                # No pre-ping: it costs a round trip per message. A connection that died with its database
                # fails one message, which is retried, and the pool replaces its connections.
                self._engine = create_engine(
                    self.db_url, pool_size=self.pool_size, max_overflow=self.pool_size, pool_pre_ping=False
                )
                engine = self._engine
                os.register_at_fork(after_in_child=lambda: engine.dispose(close=False))
            return self._engine

    @property
    def redis(self) -> Any:
        with self._lock:
            if isinstance(self._redis, str):
                import redis

                self._redis = redis.Redis.from_url(self._redis)
            return self._redis

    def client(
        self,
        meta: str | None = None,
        brokers: Sequence[str] = (),
        token: str | None = None,
        client_id: str | None = None,
    ) -> Client:
        """A client for the brokers; arguments given here win over the app's."""
        if meta or brokers:
            return Client(
                meta=meta or None, brokers=list(brokers) or None, token=token or self.token, client_id=client_id
            )
        return Client(
            meta=self.meta, brokers=list(self.brokers) or None, token=token or self.token, client_id=client_id
        )
