"""qmq's optional compiled modules (setup.py builds them with Cython where a C compiler is): each
has a pure-Python original that does the same work and is used when the compiled one is missing or
turned off. `QMQ_PURE_PYTHON=1` in the environment turns them all off, to rule them out when looking
for a fault.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

PURE_PYTHON_ENV = "QMQ_PURE_PYTHON"


def turned_off() -> bool:
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


def load(name: str) -> ModuleType | None:
    """The compiled module `name`, or None when it is not built or turned off."""
    if turned_off():
        return None
    try:
        return importlib.import_module(name)
    except ImportError:  # not built: no Cython or no compiler where qmq was installed
        return None
