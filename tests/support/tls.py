"""Test certificates, made with qmq's own openssl helpers (qmq/dev/certs.py): a CA, a server
certificate for 127.0.0.1 and localhost, and a client certificate, all signed by the CA; and a
second CA that signed none of them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qmq.dev.certs import make_ca, make_signed, server_extensions

DAYS = 2


@dataclass(frozen=True)
class Certs:
    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    other_ca: str  # trusts nothing of the above


def make_certs(directory: Path) -> Certs:
    directory.mkdir(parents=True, exist_ok=True)
    make_ca(directory, "ca", DAYS)
    make_ca(directory, "other-ca", DAYS)
    make_signed(directory, "server", "ca", server_extensions(), DAYS)
    make_signed(directory, "client", "ca", "extendedKeyUsage=clientAuth\n", DAYS)
    path = lambda name: str(directory / name)  # noqa: E731
    return Certs(
        path("ca.pem"),
        path("server.pem"),
        path("server.key"),
        path("client.pem"),
        path("client.key"),
        path("other-ca.pem"),
    )
