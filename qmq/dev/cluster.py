"""The embedded cluster behind `qmq dev` and `qmq demo`: a meta server, one broker group, the delay
server, a relay and (for `qmq dev`, when its extra is installed) the web console, as child processes
of this one, on one data directory.

Defaults suit a laptop: SQLite for the meta server and the outbox unless a URL is given (give your
application's own database, so that the relay ships what your app commits while a broker is down),
the ports of DESIGN.md (or free ones). With `tls`, every server speaks TLS only, with a certificate
made for the session (qmq/dev/certs.py): clients trust `tls_ca` (`QMQ_TLS_CA`).

Promises: `start` returns once every server accepts connections (or raises, naming the one that did
not start and its log); a server that exits later is reported by `supervise` and started again after
a pause, the others running on meanwhile; `stop` ends them all, SIGTERM first then SIGKILL, and is
safe to call twice.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import sqlalchemy as sa

from qmq.db.migrate import upgrade
from qmq.db.url import normalize_url
from qmq.dev.certs import SessionCerts, session_certs
from qmq.net.probe import accepts
from qmq.net.tls import TLS_CA_ENV

HOST = "127.0.0.1"
META_PORT = 20880
BROKER_PORT = 20881
DELAY_PORT = 20890
CONSOLE_PORT = 20900
BROKER_GROUP = "dev"
READY_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0
RESTART_AFTER_S = 2.0  # a server that exited is started again after this pause...
RESTART_MAX_S = 60.0  # ...doubled each time it dies again within STABLE_S of a start, up to this
STABLE_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    return accepts(HOST, port)


@dataclass
class Server:
    name: str
    args: list[str]
    port: int | None  # None: not a server (the relay)
    log_path: Path
    metrics_port: int | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    exited_at: float | None = None  # set while it is down, waiting to be started again
    pause_s: float = 0.0  # before the next start


@dataclass
class DevCluster:
    """Start with `start()`; `meta`, `broker`, `delay` and `outbox_url` say where things are."""

    data_dir: Path
    outbox_url: str | None = None  # default: SQLite in data_dir
    meta_db_url: str | None = None  # default: SQLite in data_dir
    meta_port: int = META_PORT  # 0: a free port
    broker_port: int = BROKER_PORT
    delay_port: int = DELAY_PORT
    metrics_port: int | None = None  # meta here, the broker +1, the delay server +2, the relay +3; 0: free ports
    console_port: int | None = None  # the web console's (qmq console); None: no console; 0: a free port
    relay_poll_s: float = 0.5
    restart_after_s: float = RESTART_AFTER_S
    tls: bool = False  # every server TLS only, with a certificate made at start (clients: tls_ca)
    servers: list[Server] = field(default_factory=list)
    certs: SessionCerts | None = field(default=None, init=False)
    console_missing: bool = field(default=False, init=False)  # asked for, but its extra is not installed

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).resolve()
        self.meta_port = self.meta_port or free_port()
        self.broker_port = self.broker_port or free_port()
        self.delay_port = self.delay_port or free_port()
        if self.console_port is not None and not console_installed():
            self.console_port = None
            self.console_missing = True
        elif self.console_port is not None:
            self.console_port = self.console_port or free_port()
        self.outbox_url = normalize_url(self.outbox_url or f"sqlite:///{self.data_dir / 'outbox.sqlite3'}")
        self.meta_db_url = normalize_url(self.meta_db_url or f"sqlite:///{self.data_dir / 'meta.sqlite3'}")

    @property
    def meta(self) -> str:
        return f"{HOST}:{self.meta_port}"

    @property
    def broker(self) -> str:
        return f"{HOST}:{self.broker_port}"

    @property
    def delay(self) -> str:
        return f"{HOST}:{self.delay_port}"

    @property
    def tls_ca(self) -> str | None:
        """The CA file clients must trust (QMQ_TLS_CA) when the cluster runs with TLS."""
        return self.certs.ca if self.certs is not None else None

    @property
    def console(self) -> str | None:
        """The web console's URL, when the cluster runs one."""
        return f"http://{HOST}:{self.console_port}" if self.console_port is not None else None

    def start(self) -> None:
        """Start every server, in dependency order, each once the one before it listens."""
        logs = self.data_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for port in (self.meta_port, self.broker_port, self.delay_port, self.console_port):
            if port is not None and _listening(port):
                raise RuntimeError(f"port {port} is taken: stop what uses it, or pick other ports")
        upgrade(self.outbox_url)
        if self.tls:
            self.certs = session_certs(self.data_dir / "tls")
        self.servers = [
            Server(
                "meta",
                ["meta", "--port", str(self.meta_port), "--db", self.meta_db_url],
                self.meta_port,
                logs / "meta.log",
            ),
            Server(
                "broker",
                [
                    "broker",
                    "--data-dir",
                    str(self.data_dir / "broker"),
                    "--port",
                    str(self.broker_port),
                    "--meta",
                    self.meta,
                    "--group",
                    BROKER_GROUP,
                ],
                self.broker_port,
                logs / "broker.log",
            ),
            Server(
                "delay-server",
                [
                    "delay-server",
                    "--data-dir",
                    str(self.data_dir / "delay"),
                    "--port",
                    str(self.delay_port),
                    "--meta",
                    self.meta,
                ],
                self.delay_port,
                logs / "delay-server.log",
            ),
            Server(
                "relay",
                ["relay", "--db", self.outbox_url, "--meta", self.meta, "--poll-interval", str(self.relay_poll_s)],
                None,
                logs / "relay.log",
            ),
        ]
        if self.metrics_port is not None:
            for offset, server in enumerate(self.servers):
                server.metrics_port = (self.metrics_port + offset) if self.metrics_port else free_port()
                server.args += ["--metrics-port", str(server.metrics_port)]
        if self.certs is not None:
            for server in self.servers:
                if server.name != "relay":  # a client only
                    server.args += ["--tls-cert", self.certs.cert, "--tls-key", self.certs.key]
        if self.console_port is not None:  # reads the others, so it starts after them (before the relay)
            self.servers.insert(
                3,
                Server(
                    "console",
                    ["console", "--port", str(self.console_port), "--meta", self.meta, "--db", self.outbox_url,
                     "--reports", str(self.data_dir / "reports")],
                    self.console_port,
                    logs / "console.log",
                ),
            )  # fmt: skip
        try:
            for server in self.servers:
                self._start(server)
        except BaseException:
            self.stop()
            raise

    def _start(self, server: Server) -> None:
        env = {**os.environ, "QMQ_TOKEN": os.environ.get("QMQ_TOKEN", "")}
        if self.certs is not None:  # the servers are clients of each other too
            env[TLS_CA_ENV] = self.certs.ca
        with open(server.log_path, "ab") as log:
            server.proc = subprocess.Popen(
                [sys.executable, "-m", "qmq", *server.args], stdout=log, stderr=log, env=env, start_new_session=True
            )
        server.started_at = time.monotonic()
        if server.port is None:
            return
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _listening(server.port):
            if server.proc.poll() is not None:
                raise RuntimeError(f"the {server.name} exited with {server.proc.returncode}; see {server.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the {server.name} did not listen on {server.port} within "
                    f"{READY_TIMEOUT_S:.0f} s; see {server.log_path}"
                )
            time.sleep(0.05)

    def dead(self) -> list[Server]:
        """Servers that exited on their own."""
        return [s for s in self.servers if s.proc is not None and s.proc.poll() is not None]

    def supervise(self) -> list[str]:
        """Notice servers that exited and start them again after their pause (longer each time one
        dies again soon after a start); the others keep running. What happened, as lines to show."""
        events = []
        now = time.monotonic()
        for server in self.servers:
            if server.proc is None:
                continue
            if server.exited_at is None and server.proc.poll() is not None:
                soon = now - server.started_at < STABLE_S
                server.pause_s = (
                    min(server.pause_s * 2, RESTART_MAX_S) if soon and server.pause_s else self.restart_after_s
                )
                server.exited_at = now
                events.append(
                    f"the {server.name} exited with {server.proc.returncode} (log {server.log_path}); the others keep "
                    f"running; starting it again in {server.pause_s:.0f} s"
                )
            elif server.exited_at is not None and now - server.exited_at >= server.pause_s:
                try:
                    self._start(server)
                except RuntimeError as exc:
                    server.exited_at = time.monotonic()
                    server.pause_s = min(server.pause_s * 2, RESTART_MAX_S)
                    events.append(f"{exc}; trying again in {server.pause_s:.0f} s")
                    continue
                server.exited_at = None
                events.append(f"the {server.name} is running again")
        return events

    def stop(self) -> None:
        """SIGTERM every server (the relay first, the meta server last), then SIGKILL what lingers."""
        running = [s for s in reversed(self.servers) if s.proc is not None and s.proc.poll() is None]
        for server in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for server in running:
            try:
                server.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.proc.pid, signal.SIGKILL)
                server.proc.wait()

    def describe(self) -> str:
        shown = sa.engine.make_url(self.outbox_url).render_as_string(hide_password=True)
        lines = [
            f"qmq dev cluster is up; data and logs in {self.data_dir}",
            f"  meta server   {self.meta}      export QMQ_META={self.meta}",
            f"  broker group  {BROKER_GROUP:<5}  {self.broker}",
            f"  delay server  {self.delay}",
            f"  relay         shipping the outbox at {shown}",
            f"                export QMQ_DB_URL={self.outbox_url}",
            "  Your app's outbox must be in that database (qmq dev --db URL of your app's database): messages it",
            "  commits while a broker is down are shipped by this relay when the broker is back.",
        ]
        if self.certs is not None:
            lines += [
                "  TLS           every server speaks TLS only; clients trust the session's CA:",
                f"                export {TLS_CA_ENV}={self.certs.ca}",
            ]
        if self.console is not None:
            lines.append(f"  web console   {self.console}")
        elif self.console_missing:
            lines.append("  web console   not installed: pip install 'qmq[console]'")
        if self.metrics_port is not None:
            ports = ", ".join(f"{s.name} {s.metrics_port}" for s in self.servers if s.metrics_port is not None)
            lines.append(f"  metrics       http://{HOST}:PORT/metrics on ports: {ports}")
        lines += [
            "Try: qmq send hello '\"world\"' --json && qmq tail hello --group me --from earliest --count 1",
            "A server that exits is started again; Ctrl-C stops everything.",
        ]
        return "\n".join(lines)


def console_installed() -> bool:
    """Whether the web console's extra (`qmq[console]`: Flask, waitress) is installed."""
    return all(importlib.util.find_spec(name) is not None for name in ("flask", "waitress"))
