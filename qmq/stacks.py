"""`kill -USR1 PID`: the stack of every thread of a qmq process, written to its stderr (its log), and
the process goes on, as with a Celery worker. How to see what a server that stops answering, or does
not stop, is waiting for (docs/operating.md)."""

from __future__ import annotations

import contextlib
import faulthandler
import signal
import sys

STACKS_SIGNAL = getattr(signal, "SIGUSR1", None)  # not on Windows


def stacks_on_signal() -> None:
    """Install the handler. The dump is written by C code in the signal handler (Python's
    `faulthandler`), so it comes even when a thread holds the GIL; nothing runs until the signal."""
    if STACKS_SIGNAL is None:
        return
    with contextlib.suppress(RuntimeError, ValueError, OSError):  # stderr without a descriptor (CliRunner)
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)
