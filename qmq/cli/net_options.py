"""Network options shared by commands: TLS as a client (every command that talks to a qmq server,
servers included, since brokers and delay servers are clients of the meta server and of brokers),
and, for the servers, TLS as a server and the limits on clients (docs/security.md).

Each decorator adds its options and takes their values out of the command's arguments, applying
them process-wide (`qmq.net.tls.configure_client`, `qmq.net.options.configure_server`) before the
command runs, so commands need no parameter of their own for them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import click

from qmq.cli.options import Decorator, stacked, tuning
from qmq.net import guard
from qmq.net.auth import MetaAuthenticator
from qmq.net.options import configure_server
from qmq.net.tls import TLS_CA_ENV, TLS_CERT_ENV, TLS_KEY_ENV, ClientTLS, configure_client, server_context

F = TypeVar("F", bound=Callable[..., Any])

TLS_SERVER_CERT_ENV = "QMQ_TLS_SERVER_CERT"
TLS_SERVER_KEY_ENV = "QMQ_TLS_SERVER_KEY"
TLS_CLIENT_CA_ENV = "QMQ_TLS_CLIENT_CA"
MIB = 1024 * 1024

_FILE = click.Path(exists=True, dir_okay=False)
_CLIENT_TLS = ("tls_ca", "tls_client_cert", "tls_client_key")
_SERVER = (
    "tls_cert",
    "tls_key",
    "tls_client_ca",
    "max_connections",
    "max_connections_per_address",
    "memory_budget",
    "idle_timeout",
    "slow_read_timeout",
)


def _file_option(flag: str, env: str, help: str) -> Decorator:
    """An option naming an existing file (a certificate, a key, a CA), also read from `env`."""
    return click.option(flag, envvar=env, type=_FILE, default=None, help=f"{help} [env {env}]")


def tls_client_options(fn: F) -> F:
    """--tls-ca, --tls-client-cert, --tls-client-key: TLS for the connections this command opens."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        ca, cert, key = (kwargs.pop(name) for name in _CLIENT_TLS)
        if (cert or key) and not ca:
            raise click.UsageError("--tls-client-cert and --tls-client-key need --tls-ca")
        if bool(cert) != bool(key):
            raise click.UsageError("give both --tls-client-cert and --tls-client-key, or neither")
        if ca:
            configure_client(ClientTLS(ca, cert, key))
        return fn(*args, **kwargs)

    return stacked(
        _file_option("--tls-ca", TLS_CA_ENV, "speak TLS to servers, trusting this CA file"),
        _file_option("--tls-client-cert", TLS_CERT_ENV, "client certificate for servers that require one"),
        _file_option("--tls-client-key", TLS_KEY_ENV, "its private key"),
    )(command)


def server_net_options(fn: F) -> F:
    """The client TLS options, plus TLS on the server's own port(s) and its limits on clients."""

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        values = {name: kwargs.pop(name) for name in _SERVER}
        cert, key, client_ca = values["tls_cert"], values["tls_key"], values["tls_client_ca"]
        if bool(cert) != bool(key):
            raise click.UsageError("give both --tls-cert and --tls-key, or neither")
        if client_ca and not cert:
            raise click.UsageError("--tls-client-ca needs --tls-cert and --tls-key")
        limits = guard.NetLimits(
            max_connections=values["max_connections"],
            max_connections_per_address=values["max_connections_per_address"],
            memory_budget_bytes=values["memory_budget"] * MIB,
            idle_timeout_s=values["idle_timeout"] or None,
            slow_read_timeout_s=values["slow_read_timeout"] or None,
        )
        # Brokers and delay servers with a meta server and a token take per-application credentials
        # too, checked by the meta server (the meta server checks its own, qmq/meta/server.py).
        meta, token = kwargs.get("meta"), kwargs.get("token")
        authenticator = MetaAuthenticator(meta, token) if meta and token else None
        tls = server_context(cert, key, client_ca) if cert else None
        configure_server(net_limits=limits, tls=tls, authenticator=authenticator)
        return fn(*args, **kwargs)

    return tls_client_options(
        stacked(
            _file_option("--tls-cert", TLS_SERVER_CERT_ENV, "serve TLS with this certificate (PEM)"),
            _file_option("--tls-key", TLS_SERVER_KEY_ENV, "the certificate's private key"),
            _file_option(
                "--tls-client-ca", TLS_CLIENT_CA_ENV, "require client certificates signed by this CA (mutual TLS)"
            ),
            tuning(
                "--max-connections",
                click.IntRange(1),
                guard.MAX_CONNECTIONS,
                "connections this server accepts at once",
            ),
            tuning(
                "--max-connections-per-address",
                click.IntRange(1),
                guard.MAX_CONNECTIONS_PER_ADDRESS,
                "connections accepted at once from one IP address",
            ),
            tuning(
                "--memory-budget",
                click.IntRange(1),
                guard.MEMORY_BUDGET_BYTES // MIB,
                "MiB of requests read and not yet answered, over all connections; above it reading waits",
                metavar="MIB",
            ),
            tuning(
                "--idle-timeout",
                click.FloatRange(0),
                guard.IDLE_TIMEOUT_S,
                "seconds without a request (none in flight) before a connection is closed; 0: never",
            ),
            tuning(
                "--slow-read-timeout",
                click.FloatRange(0),
                guard.SLOW_READ_TIMEOUT_S,
                "seconds a client may leave its replies unread before it is cut off; 0: never",
            ),
        )(command)
    )
