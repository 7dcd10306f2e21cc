"""Hooks in the spirit of Celery's signals, as plain callbacks registered on the app:

    @app.on("worker_ready")
    def ready(worker): ...

| event | called with | where, when | Celery's signal |
|---|---|---|---|
| `worker_ready` | the `Worker` | the worker, once every consumer is subscribed | `worker_ready` |
| `worker_process_init` | the `App` | each pool process, after importing the app | `worker_process_init` |
| `before_message` | the `Message` | beside the handler, before it | `task_prerun` |
| `after_message` | the `Message`, the `Outcome` | beside the handler, after every outcome | `task_postrun` |
| `on_retry` | the `Message`, the `Outcome` | beside the handler, when a retry was decided | `task_retry` |
| `on_failure` | the `Message`, the `Outcome` | beside the handler, when it is dead-lettered | `task_failure` |
| `worker_shutting_down` | the `Worker`, "warm" or "cold" | the worker, as a shutdown begins | `worker_shutting_down` |

"Beside the handler" is the thread that runs it, or its pool process with `-P processes`.

The message hooks are fired by the hooks step (worker/steps/hooks.py). An exception in a hook is
logged with its traceback and otherwise ignored: a hook never changes
what happens to a message and never stops the worker.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

log = logging.getLogger("qmq.worker")

EVENTS = (
    "worker_ready",
    "worker_process_init",
    "before_message",
    "after_message",
    "on_retry",
    "on_failure",
    "worker_shutting_down",
)


class Hooks:
    def __init__(self) -> None:
        self._callbacks: dict[str, list[Callable[..., Any]]] = defaultdict(list)

    def check(self, event: str) -> None:
        if event not in EVENTS:
            raise ValueError(f"unknown hook {event!r}; hooks are: {', '.join(EVENTS)}")

    def add(self, event: str, callback: Callable[..., Any]) -> None:
        self.check(event)
        self._callbacks[event].append(callback)

    def has(self, event: str) -> bool:
        return bool(self._callbacks.get(event))

    def fire(self, event: str, *args: Any) -> None:
        for callback in self._callbacks.get(event, ()):
            try:
                callback(*args)
            except Exception:
                log.exception("hook %s (%s) failed; carrying on", event, getattr(callback, "__qualname__", callback))
