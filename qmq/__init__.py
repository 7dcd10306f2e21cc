"""qmq: reliable, database-backed messaging for Python services.

A message that a business transaction commits is delivered; one that it rolls back never exists.
See DESIGN.md (shared) and README.md for the architecture; this package holds the library and the servers.

The public names (`qmq.Producer`, `qmq.transactional`, `qmq.NotInTransaction`, `qmq.App`,
`qmq.Message`, `qmq.Retry`, `qmq.Reject`) are imported on first use, so `import qmq` stays cheap
for the servers and the CLI. `qmq.testing` (consumers run in-process, for an app's unit tests) is
imported by name.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Producer": "qmq.outbox.producer",
    "transactional": "qmq.outbox.transactional",
    "NotInTransaction": "qmq.outbox.errors",
    "App": "worker.app",
    "Message": "worker.message",
    "Retry": "worker.errors",
    "Reject": "worker.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'qmq' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
