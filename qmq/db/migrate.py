"""Run qmq's Alembic migrations (the `migrations` package shipped with qmq) from code, no alembic.ini.

qmq's revisions form their own lineage with their own version table, QMQ_VERSION_TABLE, so they can
live in the same database as a host application's Alembic migrations without either touching the
other's `alembic_version`. Host apps pass `exclude_qmq_tables` as `include_object` in their own
`env.py` so that their autogenerate neither proposes to drop qmq's tables nor to create them.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import Script, ScriptDirectory

from qmq.db.engine import create_engine

log = logging.getLogger("qmq.db")

QMQ_VERSION_TABLE = "qmq_alembic_version"
QMQ_TABLE_PREFIX = "qmq_"
# Held (transaction-scoped) while migrating PostgreSQL, so two processes starting at once migrate in turn.
PG_ADVISORY_LOCK_KEY = 0x716D715F6D6967  # "qmq_mig"


def migrations_dir() -> Path:
    """The directory of the installed `migrations` package (env.py and versions/)."""
    import migrations

    return Path(migrations.__file__).resolve().parent


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """An Alembic Config for qmq's migrations; `connection` is what env.py migrates when given."""
    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


class TablesInTheWay(Exception):
    """Some, not all, of a revision's tables exist already: neither running nor stamping it is safe."""


def upgrade(url: str, revision: str = "head") -> str | None:
    """Bring the database at `url` to `revision` (default: the newest). A database already there is
    left as it is. A revision whose tables all exist already (made by the Django app's migrations,
    qmq/contrib/django/migrations/) is stamped instead of run. Returns the revision the database is
    at afterwards. Raises TablesInTheWay when only some of a revision's tables exist."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_ADVISORY_LOCK_KEY})
            config = alembic_config(conn)
            existing = set(sa.inspect(conn).get_table_names())
            for step in _pending(conn, config, revision):
                made = tuple(getattr(step.module, "creates", ()))
                present = [name for name in made if name in existing]
                if made and len(present) == len(made):
                    log.info(
                        "%s: already there (made by Django's migrations?); revision %s stamped, not run",
                        ", ".join(made),
                        step.revision,
                    )
                    command.stamp(config, step.revision)
                elif present:
                    raise TablesInTheWay(
                        f"revision {step.revision} creates {', '.join(made)}, but {', '.join(present)} exist(s) "
                        "already and the rest do not: drop the partial tables, or create the rest by hand and "
                        f"stamp with `alembic stamp {step.revision}`"
                    )
                else:
                    command.upgrade(config, step.revision)
        return current_revision(engine)
    finally:
        engine.dispose()


def _pending(conn: sa.Connection, config: Config, target: str) -> list[Script]:
    """The revisions from the database's current one (exclusive) to `target`, oldest first."""
    current = MigrationContext.configure(conn, opts={"version_table": QMQ_VERSION_TABLE}).get_current_revision()
    script = ScriptDirectory.from_config(config)
    steps = list(script.iterate_revisions(target, current or "base"))
    return [s for s in reversed(steps) if s.revision != current]


def current_revision(engine: sa.Engine) -> str | None:
    """The qmq revision recorded in the database, or None before the first upgrade."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": QMQ_VERSION_TABLE})
        return context.get_current_revision()


def head_revision() -> str | None:
    """The newest revision qmq ships."""
    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def exclude_qmq_tables(object: Any, name: str | None, type_: str, reflected: bool, compare_to: Any) -> bool:
    """An Alembic `include_object` hook for a host application's env.py: False for qmq's tables
    (named `qmq_*`, the version table included) and everything on them, True for the rest.

        context.configure(..., include_object=exclude_qmq_tables)

    To combine it with a hook of your own, call both and require both to be True."""
    if type_ == "table":
        return not (name or "").startswith(QMQ_TABLE_PREFIX)
    table = getattr(object, "table", None)
    table_name = getattr(table, "name", None)
    return not (isinstance(table_name, str) and table_name.startswith(QMQ_TABLE_PREFIX))
