"""`qmq db upgrade` / `qmq db current`: qmq's own tables, migrated by Alembic with qmq's own version
table (`qmq_alembic_version`), so they live beside a host application's migrations."""

from __future__ import annotations

import logging

import click
import sqlalchemy as sa

from qmq.db.engine import create_engine, safe_url
from qmq.db.migrate import TablesInTheWay, current_revision, head_revision, upgrade
from qmq.db.url import DB_URL_ENV, resolve_url

_db_option = click.option(
    "--db", "db_url", envvar=DB_URL_ENV, required=True, help=f"SQLAlchemy URL of the database [env {DB_URL_ENV}]"
)


@click.group("db")
def db() -> None:
    """qmq's tables in a SQL database (SQLite or PostgreSQL)."""


@db.command("upgrade")
@_db_option
@click.option("--revision", default="head", show_default=True, help="the revision to upgrade to")
def upgrade_cmd(db_url: str, revision: str) -> None:
    """Create or upgrade qmq's tables; a database already up to date is left as it is, and tables
    that exist already (made by the Django app's migrations) are stamped instead of created."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    url = resolve_url(db_url)
    engine = create_engine(url)
    try:
        shown = safe_url(engine)
    finally:
        engine.dispose()
    try:
        at = upgrade(url, revision)
    except sa.exc.OperationalError as exc:
        raise click.ClickException(f"cannot reach {shown}: {str(exc.orig or exc).strip()}") from None
    except TablesInTheWay as exc:
        raise click.ClickException(f"{shown}: {exc}") from None
    except sa.exc.DatabaseError as exc:
        raise click.ClickException(f"{shown}: the upgrade failed: {str(exc.orig or exc).strip()}") from None
    click.echo(f"{shown}: qmq tables at revision {at}")


@db.command("current")
@_db_option
def current_cmd(db_url: str) -> None:
    """Print the revision of qmq's tables in the database (and whether it is the newest)."""
    engine = create_engine(resolve_url(db_url))
    try:
        at = current_revision(engine)
        shown = safe_url(engine)
    finally:
        engine.dispose()
    head = head_revision()
    state = "up to date" if at == head else f"behind, the newest is {head}"
    click.echo(f"{shown}: qmq tables at revision {at or 'none'} ({state})")
