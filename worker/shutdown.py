"""Signals to shutdown requests, as Celery has them:

- warm, on SIGTERM or the first SIGINT: stop pulling, finish what was pulled, acknowledge, exit 0;
  further SIGTERMs are ignored;
- cold, on a second SIGINT or on SIGQUIT: stop now; what was not acknowledged is delivered again.

The handlers only set events (nothing that takes a lock or raises inside a handler's code, such as
a database commit); the worker's threads act on them.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType


class Shutdown:
    def __init__(self) -> None:
        self.warm = threading.Event()
        self.cold = threading.Event()
        self.cold_signal = signal.SIGQUIT

    def install(self) -> None:
        """Install the handlers (from the main thread)."""
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(signal.SIGINT, self._on_int)
        signal.signal(signal.SIGQUIT, self._on_quit)

    def _on_term(self, signum: int, frame: FrameType | None) -> None:
        self.warm.set()

    def _on_int(self, signum: int, frame: FrameType | None) -> None:
        if self.warm.is_set():
            self._go_cold(signal.SIGINT)
        self.warm.set()

    def _on_quit(self, signum: int, frame: FrameType | None) -> None:
        self._go_cold(signal.SIGQUIT)

    def _go_cold(self, sig: signal.Signals) -> None:
        self.cold_signal = sig
        self.cold.set()
