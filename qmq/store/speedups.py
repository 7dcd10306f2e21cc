"""Which of the log store's per-record loops run compiled (qmq/store/_speedups.pyx, built by
setup.py when Cython and a C compiler are there) and which in Python. Both do the same work byte for
byte; the compiled one is what makes a replica keep up with its master (docs/benchmarks.md).

`QMQ_PURE_PYTHON=1` in the environment turns the compiled loops off, to rule them out when looking
for a fault. `COMPILED` says which are in use; `qmq broker` and `qmq delay-server` log it at start.
"""

from __future__ import annotations

import logging
import os

PURE_PYTHON_ENV = "QMQ_PURE_PYTHON"

if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
    compiled = None
else:
    try:
        from qmq.store import _speedups as compiled
    except ImportError:  # not built: no Cython or no compiler where qmq was installed
        compiled = None

COMPILED = compiled is not None


def describe() -> str:
    """One line for a server's start-up log."""
    if COMPILED:
        return "compiled store loops (qmq.store._speedups)"
    if os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0"):
        return f"pure-Python store loops ({PURE_PYTHON_ENV} is set)"
    return "pure-Python store loops (qmq.store._speedups not built: install with Cython and a C compiler)"


def log_in_use(logger: logging.Logger) -> None:
    """Say at a server's start which loops it runs: a warning when they are not compiled, as a replica
    then keeps up with its master only at a lower rate."""
    if COMPILED:
        logger.info("%s", describe())
    else:
        logger.warning("%s", describe())
