"""Which of the log store's per-record loops run compiled (qmq/store/_speedups.pyx, built by
setup.py when Cython and a C compiler are there) and which in Python. Both do the same work byte for
byte; the compiled ones in a quarter to a half of the time (docs/benchmarks.md).

`QMQ_PURE_PYTHON=1` in the environment turns the compiled loops off (qmq/compiled.py). `COMPILED`
says which are in use; `qmq broker` and `qmq delay-server` log it at start.
"""

from __future__ import annotations

import logging

from qmq.compiled import PURE_PYTHON_ENV, load, turned_off

compiled = load("qmq.store._speedups")
COMPILED = compiled is not None


def describe() -> str:
    """One line for a server's start-up log."""
    if COMPILED:
        if load("qmq.store._sync_thread") is None:
            return "compiled store loops (qmq.store._speedups), a Python fsync thread (_sync_thread not built)"
        return "compiled store loops (qmq.store._speedups) and fsync thread (qmq.store._sync_thread)"
    if turned_off():
        return f"pure-Python store loops ({PURE_PYTHON_ENV} is set)"
    return "pure-Python store loops (qmq.store._speedups not built: install with Cython and a C compiler)"


def log_in_use(logger: logging.Logger) -> None:
    """Say at a server's start which loops it runs: a warning when they are not compiled, as the
    server then spends more CPU on every message it stores or replicates."""
    if COMPILED:
        logger.info("%s", describe())
    else:
        logger.warning("%s", describe())
