"""The network options a process sets once for every qmq server it runs (its listeners' limits on
clients, TLS) and every connection it opens to another server (TLS as a client).

The `qmq meta`, `qmq broker` and `qmq delay-server` commands set them from their flags
(`qmq.cli.net_options`); `qmq.net.server.Server` and the clients read them when not given their own.
One process-wide setting rather than a parameter threaded through every server: a broker's listener,
its membership connection to the meta server and a delay server's connections to brokers must all
use the same settings, and `qmq dev` runs every server in one process with one set of flags.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass, replace

from qmq.net.auth import Authenticator
from qmq.net.guard import DEFAULT_NET_LIMITS, NetLimits


@dataclass(frozen=True)
class ServerOptions:
    """What a server's listeners use unless told otherwise."""

    net_limits: NetLimits = DEFAULT_NET_LIMITS
    tls: ssl.SSLContext | None = None  # a server-side context: listeners speak TLS
    # Checks per-application credentials presented in handshakes (`qmq.net.auth`); None: only the
    # shared token is accepted.
    authenticator: Authenticator | None = None


_server_options = ServerOptions()


def server_options() -> ServerOptions:
    return _server_options


def configure_server(**changes: object) -> ServerOptions:
    """Change the process's server options (fields of `ServerOptions`) and return the new ones."""
    global _server_options
    _server_options = replace(_server_options, **changes)  # type: ignore[arg-type]
    return _server_options
