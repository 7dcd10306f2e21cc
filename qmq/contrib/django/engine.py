"""A SQLAlchemy engine on a Django database alias, for the producer's sender and the relay: they
read and mark outbox rows on connections of their own, outside the request's transaction."""

from __future__ import annotations

import sqlalchemy as sa
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from qmq.db.engine import create_engine, prepare_nothing


def url_for_alias(alias: str) -> sa.URL:
    """The SQLAlchemy URL of Django's `DATABASES[alias]` (PostgreSQL or SQLite)."""
    conf = settings.DATABASES[alias]
    backend = conf["ENGINE"]
    if backend.endswith("postgresql"):
        return sa.URL.create(
            "postgresql+psycopg",
            username=conf.get("USER") or None,
            password=conf.get("PASSWORD") or None,
            host=conf.get("HOST") or None,
            port=int(conf["PORT"]) if conf.get("PORT") else None,
            database=conf["NAME"],
        )
    if backend.endswith("sqlite3"):
        return sa.URL.create("sqlite", database=str(conf["NAME"]))
    raise ImproperlyConfigured(f"qmq's outbox supports PostgreSQL and SQLite; database {alias!r} uses {backend}")


def engine_for_alias(alias: str) -> sa.Engine:
    """qmq's own engine on the alias's database; it prepares nothing, so that it works through
    PgBouncer in transaction mode like Django's own connections (docs/outbox.md)."""
    engine = create_engine(url_for_alias(alias).render_as_string(hide_password=False))
    prepare_nothing(engine)
    return engine
