"""`Consumer`: one handler and how it consumes (subject, group, filters, retry policy, time limit,
idempotency), as `@app.consumer(...)` declares it (worker/app.py), and what of its app the steps
around the handler reach (`ConsumerApp`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal, Protocol

from sqlalchemy.engine import Engine

from worker.database import ConsumerDatabase
from worker.hooks import Hooks
from worker.retry_policy import RetryPolicy

Idempotent = bool | Literal["redis"]


class ConsumerApp(Protocol):
    """The parts of a `qmq.App` that the steps use (worker/steps/)."""

    name: str
    hooks: Hooks
    steps: list[Callable[..., Any]]  # the app's own steps (worker/steps/step.py: Step)
    redis_prefix: str
    idempotency_window: timedelta

    @property
    def database(self) -> ConsumerDatabase: ...

    @property
    def engine(self) -> Engine: ...

    @property
    def redis(self) -> Any: ...


@dataclass(eq=False)
class Consumer:
    """One handler and how it consumes: made by `App.consumer`."""

    app: ConsumerApp
    fn: Callable[..., Any]
    subject: str
    group: str
    tags: tuple[str, ...] = ()
    match_all: bool = False
    broadcast: bool = False
    start: str | None = None  # where a group new to a broker starts; None: the worker's --from (earliest)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    time_limit: float | None = None
    idempotent: Idempotent = False
    wants_session: bool = False
    ordered: bool = False  # one message of a key at a time, in order (docs/ordering.md)
    on_poison: str = "dead-letter"  # ordered: after max_retries, "dead-letter" (the key goes on) or "stop"

    @property
    def name(self) -> str:
        return f"{self.subject}/{self.group}"

    @property
    def uses_db(self) -> bool:
        return self.idempotent is True or self.wants_session

    def call_handler(self, message: Any, session: Any) -> Any:
        if self.wants_session:
            return self.fn(message, session=session)
        return self.fn(message)
