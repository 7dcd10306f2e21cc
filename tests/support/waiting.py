"""Waiting for another process's state (its tables, its log file, its stats) where the test has no
event to await: one poll loop, so every wait fails the same way, naming what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

POLL_S = 0.05  # between two looks


def wait_until(
    condition: Callable[[], Any],
    what: str,
    deadline_s: float,
    *,
    explain: Callable[[], str] | None = None,
    poll_s: float = POLL_S,
) -> Any:
    """Call `condition` until it returns something truthy, and return that; after `deadline_s`, fail
    naming `what` (and `explain()`, when given: the state that was waited on)."""
    deadline = time.monotonic() + deadline_s
    while True:
        if result := condition():
            return result
        if time.monotonic() > deadline:
            detail = f"\n{explain()}" if explain is not None else ""
            raise AssertionError(f"not within {deadline_s:g} s: {what}{detail}")
        time.sleep(poll_s)
