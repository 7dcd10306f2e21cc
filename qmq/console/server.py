"""The `qmq console` process: the administration clients, the sampler thread, the Flask application,
served by waitress (a production WSGI server) until SIGTERM or Ctrl-C.

Promises: it listens once `serve` logs "console ready on http://..." (the address, with the port it
got when given 0); it binds 127.0.0.1 unless told otherwise; a cluster that cannot be reached makes
pages that say so, never a crash.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from waitress import create_server

from qmq.client.blocking import Admin
from qmq.console.actions import ActionLog
from qmq.console.app import DEFAULT_REFRESH_S, Console, create_app
from qmq.console.auth import Access
from qmq.console.history import DEFAULT_HISTORY_S, DEFAULT_SAMPLE_INTERVAL_S, History, Sampler

log = logging.getLogger("qmq.console")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 20900
THREADS = 8  # requests served at once


@dataclass
class ConsoleSettings:
    meta: str | None = None
    brokers: Sequence[str] = ()
    delay_servers: Sequence[str] = ()
    token: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    sample_interval_s: float = DEFAULT_SAMPLE_INTERVAL_S
    history_s: float = DEFAULT_HISTORY_S
    refresh_s: float = DEFAULT_REFRESH_S
    reports: Path | None = None
    db_url: str | None = None
    read_only: bool = False
    action_log: Path | None = None


def admin_client(settings: ConsoleSettings, name: str) -> Admin:
    return Admin(
        meta=settings.meta or None,
        brokers=list(settings.brokers) or None,
        delay_servers=list(settings.delay_servers) or None,
        token=settings.token or None,
        client_id=name,
    )


def serve(settings: ConsoleSettings, on_ready: Callable[[str], Any] | None = None) -> None:
    """Serve until SIGTERM or SIGINT. `on_ready` gets the console's URL once it listens."""
    pages_admin = admin_client(settings, "qmq-console")
    sampler_admin = admin_client(settings, "qmq-console-sampler")
    history = History(settings.history_s, settings.sample_interval_s)
    sampler = Sampler(history, sampler_admin.stats, settings.sample_interval_s)
    state = Console(
        admin=pages_admin,
        history=history,
        access=Access(settings.token, settings.read_only),
        actions=ActionLog(settings.action_log),
        refresh_s=settings.refresh_s,
        reports=settings.reports,
        db_url=settings.db_url,
    )
    server = create_server(create_app(state), host=settings.host, port=settings.port, threads=THREADS, ident="qmq")
    url = f"http://{settings.host}:{server.effective_port}"

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, stop)
    sampler.start()
    where = settings.meta or ", ".join(settings.brokers)
    who = "read-only" if settings.read_only else ("actions need the token" if settings.token else "no token set")
    log.warning("console ready on %s (cluster %s; %s)", url, where, who)
    if on_ready is not None:
        on_ready(url)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        server.close()
        sampler.stop()
        pages_admin.close()
        sampler_admin.close()
    log.warning("console stopped")
