"""A pool process (`-P processes`): imports the app itself, fires `worker_process_init`, then runs the
inner chain (hooks, retry, steps, transaction, idempotency, time limit, handler) for each message
its parent sends, answering with the outcome. It ignores SIGINT and SIGTERM (a Ctrl-C reaches the
whole process group, and systemd signals the whole control group: the parent decides how to stop)
and exits when the parent says so or goes away. SIGUSR1 writes its threads' stacks to the log, as in
every qmq process (qmq/stacks.py): where a handler is stuck.
"""

from __future__ import annotations

import logging
import signal
from multiprocessing.connection import Connection

from qmq.stacks import stacks_on_signal
from worker.loading import load_app
from worker.pipeline import inner_chain
from worker.steps.step import Call, Next

LOG_FORMAT = "%(asctime)s %(processName)s %(name)s %(levelname)s %(message)s"


def child_main(app_spec: str, conn: Connection, log_level: str) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    stacks_on_signal()
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    app = load_app(app_spec)
    chains: dict[tuple[str, str], tuple[Next, object]] = {
        (c.subject, c.group): (inner_chain(c), c) for c in app.consumers
    }
    app.hooks.fire("worker_process_init", app)
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if request is None:
            return
        subject, group, message = request
        inner, consumer = chains[(subject, group)]
        outcome = inner(Call(message, consumer))  # type: ignore[arg-type]
        conn.send(outcome.portable())
