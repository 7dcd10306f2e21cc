"""Test-only crash points: a server started with `QMQ_TEST_CRASH_AT=<name>` SIGKILLs itself when it
reaches the point of that name, so a test stops a real process exactly there (a crash mid-install,
a master lost while a replica copies its state) without sleeps. Unset, a point costs a dict lookup.

Points: `snapshot-install` (a broker replica, part of a copied state written, the install marker
still there), `snapshot-read` (a master, asked for a part of its state by a replica copying it),
`fetch-after-install` (a master, at the first fetch of a replica it gave a copy of its state),
`fetch-after-copy` (the same once that replica holds some of the log past the copy's start).
"""

from __future__ import annotations

import os
import signal

CRASH_AT_ENV = "QMQ_TEST_CRASH_AT"


def crash_point(name: str) -> None:
    if os.environ.get(CRASH_AT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)
