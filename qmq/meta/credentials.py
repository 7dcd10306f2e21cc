"""Per-application credentials, kept by the meta server in its database: the table, the store, and
the meta server's handlers for them (create, list, revoke, and the check brokers and delay servers
make when a client presents a credential in its handshake).

A credential's token is `qmqc.<id>.<secret>`: the id names the row, the secret (32 random bytes) is
shown once, at creation, and only its SHA-256 is stored (a random secret needs no slow hash); a
presented secret is compared with `hmac.compare_digest`. Tokens are never logged. A revoked
credential is refused from the next check on (brokers cache a check for CHECK_CACHE_S at most).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Engine

from qmq.db.metadata import metadata
from qmq.meta.schema import NAME_LEN, as_utc
from qmq.net.acl import Principal
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import ErrorCode, ProtocolError
from qmq.protocol.fields import bad, field

log = logging.getLogger("qmq.meta")

TOKEN_PREFIX = "qmqc"
ID_BYTES = 8  # 16 hex characters
SECRET_BYTES = 32
MAX_PATTERNS = 64
MAX_PATTERN_LEN = 300

credential = sa.Table(
    "qmq_meta_credential",
    metadata,
    sa.Column("id", sa.String(32), primary_key=True),
    sa.Column("app", sa.String(NAME_LEN), nullable=False),
    sa.Column("secret_sha256", sa.String(64), nullable=False),
    sa.Column("produce", sa.Text(), nullable=False),  # JSON list of fnmatch patterns on subjects
    sa.Column("consume", sa.Text(), nullable=False),  # JSON list of patterns on 'subject:group'
    sa.Column("admin", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
)
sa.Index("ix_qmq_meta_credential_app", credential.c.app)


def is_credential(token: object) -> bool:
    """Whether a handshake token has a credential's form (else it can only be the shared token)."""
    return isinstance(token, str) and token.startswith(TOKEN_PREFIX + ".") and token.count(".") == 2


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class CredentialStore:
    """The credentials in the meta database. Blocking: the meta server calls it in a thread."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def create(self, app: str, produce: list[str], consume: list[str], admin: bool) -> tuple[Principal, str]:
        """A new credential and its token (the only time the secret exists in clear)."""
        credential_id, secret = secrets.token_hex(ID_BYTES), secrets.token_urlsafe(SECRET_BYTES)
        with self.engine.begin() as conn:
            conn.execute(
                credential.insert().values(
                    id=credential_id,
                    app=app,
                    secret_sha256=_digest(secret),
                    produce=json.dumps(produce),
                    consume=json.dumps(consume),
                    admin=admin,
                    created_at=datetime.now(UTC),
                )
            )
        principal = Principal(credential_id, app, tuple(produce), tuple(consume), admin)
        return principal, f"{TOKEN_PREFIX}.{credential_id}.{secret}"

    def list(self) -> list[dict[str, Any]]:
        with self.engine.connect() as conn:
            rows = conn.execute(credential.select().order_by(credential.c.app, credential.c.created_at)).all()
        return [
            {
                "id": row.id,
                "app": row.app,
                "produce": json.loads(row.produce),
                "consume": json.loads(row.consume),
                "admin": row.admin,
                "created_at": as_utc(row.created_at).isoformat(),
                "revoked_at": as_utc(row.revoked_at).isoformat() if row.revoked_at else None,
            }
            for row in rows
        ]

    def revoke(self, credential_id: str) -> bool:
        with self.engine.begin() as conn:
            done = conn.execute(
                credential.update()
                .where(credential.c.id == credential_id, credential.c.revoked_at.is_(None))
                .values(revoked_at=datetime.now(UTC))
            )
        return done.rowcount > 0

    def check(self, token: str) -> Principal | None:
        """The principal a token stands for, or None (unknown, revoked or a wrong secret)."""
        if not is_credential(token):
            return None
        _prefix, credential_id, secret = token.split(".")
        with self.engine.connect() as conn:
            row = conn.execute(credential.select().where(credential.c.id == credential_id[:32])).first()
        if row is None or row.revoked_at is not None:
            return None
        if not hmac.compare_digest(row.secret_sha256.encode(), _digest(secret).encode()):
            return None
        return Principal(row.id, row.app, tuple(json.loads(row.produce)), tuple(json.loads(row.consume)), row.admin)


def _patterns(body: dict[str, Any], name: str) -> list[str]:
    patterns = field(body, name, list, [])
    if len(patterns) > MAX_PATTERNS or not all(isinstance(p, str) and 0 < len(p) <= MAX_PATTERN_LEN for p in patterns):
        raise bad(f"field {name!r} must be a list of at most {MAX_PATTERNS} patterns of 1-{MAX_PATTERN_LEN} characters")
    return patterns


def credential_handlers(
    store: CredentialStore, db: Callable[..., Awaitable[Any]]
) -> dict[int, Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]]:
    """The meta server's handlers for credentials; `db(fn, *args)` runs a blocking call off the loop
    (the meta service's, so a database outage is answered UNAVAILABLE)."""

    async def create(body: dict[str, Any]) -> dict[str, Any]:
        app = field(body, "app", str)
        if not 0 < len(app) <= NAME_LEN:
            raise bad(f"field 'app' must be 1-{NAME_LEN} characters")
        produce, consume = _patterns(body, "produce"), _patterns(body, "consume")
        admin = field(body, "admin", bool, False)
        principal, token = await db(store.create, app, produce, consume, admin)
        log.info("credential %s created for application %s", principal.id, app)
        return {**principal.to_wire(), "token": token}

    async def list_(body: dict[str, Any]) -> dict[str, Any]:
        return {"credentials": await db(store.list)}

    async def revoke(body: dict[str, Any]) -> dict[str, Any]:
        credential_id = field(body, "id", str)
        revoked = await db(store.revoke, credential_id[:32])
        if revoked:
            log.info("credential %s revoked", credential_id[:32])
        return {"revoked": revoked}

    async def check(body: dict[str, Any]) -> dict[str, Any]:
        principal = await db(store.check, field(body, "token", str))
        if principal is None:
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "unknown or revoked credential", fatal=False)
        return principal.to_wire()

    return {
        RequestCode.META_CREDENTIAL_CREATE: create,
        RequestCode.META_CREDENTIAL_LIST: list_,
        RequestCode.META_CREDENTIAL_REVOKE: revoke,
        RequestCode.META_CREDENTIAL_CHECK: check,
    }


class LocalAuthenticator:
    """The meta server's own check of a credential: straight from its database."""

    def __init__(self, store: CredentialStore) -> None:
        self.store = store

    async def authenticate(self, token: str) -> Principal | None:
        return await asyncio.to_thread(self.store.check, token)
