"""One place that turns a database URL given by a user into the URL qmq hands to SQLAlchemy.

Users write `postgresql://...` (what psql, libpq and most hosting providers print); SQLAlchemy would
pick psycopg2 for that, which qmq does not depend on. qmq speaks psycopg 3, so every URL goes through
`normalize_url` before an engine is made.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands that only name the variable do not load SQLAlchemy
    import sqlalchemy as sa

DB_URL_ENV = "QMQ_DB_URL"
DEFAULT_META_DB_URL = "sqlite:///qmq-meta.sqlite3"  # a file in the current directory

_PSYCOPG_PREFIXES = ("postgresql://", "postgres://", "postgresql+psycopg3://")


def normalize_url(url: str) -> str:
    """`postgresql://` (and `postgres://`) become `postgresql+psycopg://`; anything else, including an
    explicit driver such as `postgresql+psycopg2://` or `sqlite:///file`, is returned unchanged."""
    url = url.strip()
    if not url:
        raise ValueError("database URL is empty")
    for prefix in _PSYCOPG_PREFIXES:
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def resolve_url(url: str | None, default: str | None = None) -> str:
    """The explicit URL, else `$QMQ_DB_URL`, else `default`, normalised. Raises ValueError if none."""
    chosen = url or os.environ.get(DB_URL_ENV) or default
    if not chosen:
        raise ValueError(f"no database URL: pass --db or set ${DB_URL_ENV}")
    return normalize_url(chosen)


def same_database(a: sa.URL, b: sa.URL) -> bool:
    """Whether two URLs name the same database (whatever the driver or password)."""
    return (a.get_backend_name(), a.host, a.port, a.database, a.username) == (
        b.get_backend_name(),
        b.host,
        b.port,
        b.database,
        b.username,
    )
