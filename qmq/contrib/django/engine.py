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


# OPTIONS that Django's PostgreSQL backend takes for itself; the others are psycopg's connection
# parameters (sslmode, sslrootcert, options, application_name, service, ...), which qmq's engine takes too.
DJANGO_ONLY_OPTIONS = frozenset(
    {"assume_role", "isolation_level", "pool", "server_side_binding", "cursor_factory", "context", "prepare_threshold"}
)


def connect_args_for_alias(alias: str) -> dict[str, object]:
    """The connection parameters of `DATABASES[alias]["OPTIONS"]` that a psycopg connection takes
    (TLS settings, `options`, ...), so that qmq connects as Django does. PostgreSQL only."""
    conf = settings.DATABASES[alias]
    if not conf["ENGINE"].endswith("postgresql"):
        return {}
    return {k: v for k, v in (conf.get("OPTIONS") or {}).items() if k not in DJANGO_ONLY_OPTIONS}


def engine_for_alias(alias: str) -> sa.Engine:
    """qmq's own engine on the alias's database, with the alias's connection OPTIONS; it prepares
    nothing (as Django's own psycopg connections by default), so that it works through PgBouncer in
    transaction mode (docs/outbox.md)."""
    url = url_for_alias(alias).render_as_string(hide_password=False)
    engine = create_engine(url, connect_args=connect_args_for_alias(alias))
    prepare_nothing(engine)
    return engine
