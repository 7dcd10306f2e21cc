"""TLS for qmq connections, with the standard `ssl` module: the server-side context a listener uses
(`--tls-cert`, `--tls-key`, and `--tls-client-ca` to require client certificates: mutual TLS) and
the client-side context every connection to a qmq server uses (`--tls-ca` / `QMQ_TLS_CA`, with
`QMQ_TLS_CERT` / `QMQ_TLS_KEY` for a client certificate).

The client context is process-wide: a broker's connection to its meta server and a delay server's
connections to brokers are clients too and use the same settings (`configure_client`, else the
environment). Without a CA no TLS is spoken. Certificates are checked as browsers do: the server's
must be signed by the CA and name the host the client dialled (an IP address SAN for an address).
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass

TLS_CA_ENV = "QMQ_TLS_CA"  # clients: the CA file that signs the servers' certificates; set = use TLS
TLS_CERT_ENV = "QMQ_TLS_CERT"  # clients: a certificate to present (servers with --tls-client-ca ask)
TLS_KEY_ENV = "QMQ_TLS_KEY"  # clients: its private key
MIN_TLS_VERSION = ssl.TLSVersion.TLSv1_2


@dataclass(frozen=True)
class ClientTLS:
    """Where a client's TLS material lives."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=self.ca)
        context.minimum_version = MIN_TLS_VERSION
        if self.cert:
            context.load_cert_chain(self.cert, self.key)
        return context


def server_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A listener's context; with `client_ca`, clients must present a certificate it signed."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = MIN_TLS_VERSION
    context.load_cert_chain(cert, key)
    if client_ca:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context


_configured: ClientTLS | None = None
_contexts: dict[ClientTLS, ssl.SSLContext] = {}


def configure_client(tls: ClientTLS | None) -> None:
    """Set the TLS material of every client connection this process opens (None: back to the
    environment). The commands call it from `--tls-ca`, `--tls-client-cert`, `--tls-client-key`."""
    global _configured
    _configured = tls


def client_settings() -> ClientTLS | None:
    """The configured client TLS material, else the environment's, else None (plain TCP)."""
    if _configured is not None:
        return _configured
    ca = os.environ.get(TLS_CA_ENV)
    if not ca:
        return None
    return ClientTLS(ca, os.environ.get(TLS_CERT_ENV) or None, os.environ.get(TLS_KEY_ENV) or None)


def client_context() -> ssl.SSLContext | None:
    """The SSL context for a new client connection (made once per setting), or None for plain TCP."""
    settings = client_settings()
    if settings is None:
        return None
    context = _contexts.get(settings)
    if context is None:
        context = _contexts[settings] = settings.context()
    return context


def closed_before_handshake_hint(tls: bool) -> str:
    """What to add when a server closes a connection before answering its handshake."""
    if tls:
        return " (a TLS server that refused this client's certificate, or no TLS server at all?)"
    return f" (if it is a TLS server, give the client its CA: --tls-ca or ${TLS_CA_ENV})"
