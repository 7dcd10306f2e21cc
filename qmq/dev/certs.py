"""Certificates for a TLS cluster on one machine (`qmq dev --tls`, `qmq demo --tls`), made with the
`openssl` command line (the `cryptography` package is not a dependency of qmq): a CA made for the
session and a server certificate it signs for 127.0.0.1 and localhost, which every server of the
cluster presents. Clients trust the CA (`--tls-ca` / `QMQ_TLS_CA`). The tests make theirs with the
same functions (tests/support/tls.py).
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SESSION_DAYS = 30  # a dev cluster's certificates are made again at each start; this is ample
SERVER_NAMES = ("IP:127.0.0.1", "DNS:localhost")
KEY = "rsa:2048"


class CertificateError(RuntimeError):
    """The certificates could not be made (no openssl, or openssl failed): the message says why."""


@dataclass(frozen=True)
class SessionCerts:
    ca: str  # what clients trust: QMQ_TLS_CA
    cert: str  # what every server presents: --tls-cert
    key: str  # --tls-key


def openssl(*args: str, cwd: Path) -> None:
    if shutil.which("openssl") is None:
        raise CertificateError("TLS certificates are made with the openssl command, which is not installed")
    done = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise CertificateError(f"openssl {args[0]} failed: {done.stderr.strip()[-500:]}")


def make_ca(directory: Path, name: str, days: int) -> None:
    """`name.pem` and `name.key` in `directory`: a self-signed CA."""
    openssl(
        "req", "-x509", "-newkey", KEY, "-nodes", "-days", str(days), "-subj", f"/CN={name}",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=directory,
    )  # fmt: skip


def make_signed(directory: Path, name: str, ca: str, extensions: str, days: int) -> None:
    """`name.pem` and `name.key`: a certificate the CA `ca` (in `directory`) signs, with the
    x509 `extensions` given (one per line)."""
    (directory / f"{name}.ext").write_text(extensions)
    openssl(
        "req", "-newkey", KEY, "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
        "-out", f"{name}.csr", cwd=directory,
    )  # fmt: skip
    openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
        "-days", str(days), "-extfile", f"{name}.ext", "-out", f"{name}.pem", cwd=directory,
    )  # fmt: skip


def server_extensions(names: tuple[str, ...] = SERVER_NAMES) -> str:
    return f"subjectAltName={','.join(names)}\nextendedKeyUsage=serverAuth\n"


def session_certs(directory: Path) -> SessionCerts:
    """A new CA and server certificate in `directory` (made again each time: a session's own)."""
    directory.mkdir(parents=True, exist_ok=True)
    make_ca(directory, "ca", SESSION_DAYS)
    make_signed(directory, "server", "ca", server_extensions(), SESSION_DAYS)
    (directory / "ca.key").unlink()  # nothing more is signed with it
    return SessionCerts(str(directory / "ca.pem"), str(directory / "server.pem"), str(directory / "server.key"))
