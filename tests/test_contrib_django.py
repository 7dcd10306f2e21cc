"""The Django flavour: the qmq app's migrations on SQLite and PostgreSQL aliases (the same table the
Alembic migrations make), and `@qmq.transactional` / `atomic` blocks on the right alias, with a real
broker."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import django
import pytest
import sqlalchemy as sa
from django.conf import settings
from django.core.management import call_command
from django.db import connections, transaction

import qmq
from qmq.db.engine import create_engine
from qmq.db.migrate import head_revision, upgrade
from qmq.outbox.schema import outbox
from tests.support.broker import HOST
from tests.support.databases import fresh_database
from tests.support.outbox import committed_ids, consume, states
from tests.support.pgbouncer import shared_session, start_pgbouncer
from tests.support.processes import ProcessManager
from tests.support.waiting import wait_until
from worker.schema import consumed

ALIASES = ["default", "orders"]  # SQLite and PostgreSQL
ORDERED_SENDS = 8  # more than psycopg's prepare_threshold (5)
CLOSED_WITHIN_S = 10.0  # a backend leaves pg_stat_activity when its process has exited
ORDERS_APP_NAME = "qmq-django-orders"  # the "orders" alias's OPTIONS name its connections so


@pytest.fixture(scope="module")
def django_dbs(pg_url, tmp_path_factory):
    """Django configured with a SQLite alias and a PostgreSQL alias, both migrated, and "bounced": the
    PostgreSQL one's database through PgBouncer in transaction mode (tests/support/pgbouncer.py), as
    Django's and qmq's guides set it up; their SQLAlchemy URLs by alias."""
    sqlite_path = tmp_path_factory.mktemp("django") / "default.sqlite3"
    bouncers = ProcessManager(tmp_path_factory.mktemp("pgbouncer"))
    with fresh_database(pg_url) as url, contextlib.ExitStack() as stop:
        stop.callback(bouncers.stop_all)
        pg = sa.engine.make_url(url)
        bouncer = start_pgbouncer(bouncers, bouncers.log_dir / "conf", pg.host, pg.port or 5432)
        settings.configure(
            INSTALLED_APPS=["qmq.contrib.django"],
            DATABASES={
                "default": {
                    "ENGINE": "django.db.backends.sqlite3",
                    "NAME": str(sqlite_path),
                    "OPTIONS": {"transaction_mode": "IMMEDIATE"},
                },  # as the guide says
                "orders": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": pg.database,
                    "USER": pg.username,
                    "HOST": pg.host,
                    "PORT": str(pg.port or 5432),
                    "OPTIONS": {"application_name": ORDERS_APP_NAME},  # a connection parameter
                },
                "bounced": {
                    "ENGINE": "django.db.backends.postgresql",
                    "NAME": pg.database,
                    "USER": pg.username,
                    "HOST": HOST,
                    "PORT": str(bouncer),
                    "DISABLE_SERVER_SIDE_CURSORS": True,  # Django's guide for transaction pooling
                },
            },
            USE_TZ=True,
        )
        django.setup()
        for alias in ALIASES:
            call_command("migrate", database=alias, verbosity=0)
            with connections[alias].cursor() as cursor:
                cursor.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, item VARCHAR(50))")
        bounced = f"postgresql+psycopg://{pg.username}@{HOST}:{bouncer}/{pg.database}"
        yield {"default": f"sqlite:///{sqlite_path}", "orders": url, "bounced": bounced}
        connections.close_all()


@pytest.fixture(params=ALIASES)
def alias(request, django_dbs):
    yield request.param
    with connections[request.param].cursor() as cursor:
        cursor.execute("DELETE FROM orders")
        cursor.execute("DELETE FROM qmq_outbox")
        cursor.execute("DELETE FROM qmq_consumed")


@pytest.fixture
def engine(django_dbs, alias):
    engine = create_engine(django_dbs[alias])
    yield engine
    engine.dispose()


@pytest.fixture
def producer(alias, broker):
    producer = qmq.Producer(brokers=[broker.address], using=alias)
    yield producer
    producer.close()


def insert_order(alias: str, order_id: int) -> None:
    with connections[alias].cursor() as cursor:
        cursor.execute("INSERT INTO orders (id, item) VALUES (%s, %s)", [order_id, "book"])


def order_ids(alias: str) -> list[int]:
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT id FROM orders ORDER BY id")
        return [r[0] for r in cursor.fetchall()]


def test_the_migrations_make_the_same_tables_as_alembic(django_dbs, alias, tmp_path, pg_url) -> None:
    def shape(url: str, table: str) -> dict:
        engine = create_engine(url)
        inspector = sa.inspect(engine)
        columns = {c["name"]: (str(c["type"]).split("(")[0], c["nullable"]) for c in inspector.get_columns(table)}
        indexes = {i["name"]: tuple(i["column_names"]) for i in inspector.get_indexes(table)}
        key = tuple(inspector.get_pk_constraint(table)["constrained_columns"])
        with engine.connect() as conn:
            options = (
                conn.execute(sa.text("SELECT reloptions FROM pg_class WHERE relname = :t"), {"t": table}).scalar()
                if engine.dialect.name == "postgresql"
                else None
            )
        engine.dispose()
        return {"columns": columns, "indexes": indexes, "key": key, "options": options}

    def shapes(url: str) -> dict:
        return {table.name: shape(url, table.name) for table in (outbox, consumed)}

    if alias == "default":
        alembic_url = f"sqlite:///{tmp_path / 'alembic.sqlite3'}"
        upgrade(alembic_url)
        assert shapes(django_dbs[alias]) == shapes(alembic_url)
    else:
        with fresh_database(pg_url) as alembic_url:
            upgrade(alembic_url)
            assert shapes(django_dbs[alias]) == shapes(alembic_url)
    for table in (outbox, consumed):
        assert set(shape(django_dbs[alias], table.name)["columns"]) == {c.name for c in table.columns}


def test_qmq_db_upgrade_stamps_what_django_migrated_and_migrate_after_it_works(django_dbs, pg_url) -> None:
    """Issue 15, case 5: `qmq db upgrade` on a database Django already migrated stamps the tables
    there instead of failing with DuplicateTable; Django's migrations on a database `qmq db upgrade`
    made skip the tables that exist."""
    upgraded = subprocess.run(
        [sys.executable, "-m", "qmq", "db", "upgrade", "--db", django_dbs["orders"]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert upgraded.returncode == 0, upgraded.stderr
    assert "revision 0002 stamped" in upgraded.stderr and "revision 0003 stamped" in upgraded.stderr
    assert "Traceback" not in upgraded.stderr
    assert f"at revision {head_revision()}" in upgraded.stdout
    with fresh_database(pg_url) as url:
        upgrade(url)
        connections.databases["alembic_first"] = {**connections.databases["orders"], "NAME": url.rsplit("/", 1)[1]}
        try:
            call_command("migrate", database="alembic_first", verbosity=0)
            with connections["alembic_first"].cursor() as cursor:
                cursor.execute("SELECT count(*) FROM django_migrations WHERE app = 'qmq'")
                assert cursor.fetchone()[0] == 3  # 0001 outbox, 0002 consumed, 0003 order_key
        finally:
            connections["alembic_first"].close()
            del connections.databases["alembic_first"]


def test_commit_delivers_rollback_never_and_a_savepoint_drops_only_its_messages(
    producer, alias, engine, broker
) -> None:
    @qmq.transactional(producer)
    def place_order(order_id: int, fail: bool = False) -> str:
        assert connections[alias].in_atomic_block  # the transaction is on the producer's alias
        insert_order(alias, order_id)
        message_id = producer.send("order.created", {"id": order_id}, tags=["django"])
        if fail:
            raise RuntimeError("declined")
        return message_id

    @qmq.transactional(producer)
    def place_two(order_id: int) -> str:
        kept = place_order(order_id)
        with pytest.raises(RuntimeError):
            place_order(order_id + 1, fail=True)  # a nested atomic block: a savepoint
        return kept

    first = place_order(1)
    with pytest.raises(RuntimeError):
        place_order(2, fail=True)
    second = place_two(10)

    assert producer.flush(10)
    assert order_ids(alias) == [1, 10]
    assert states(engine) == {first: "sent", second: "sent"}
    delivered = consume(broker.address, "order.created", 2)
    assert sorted((d.id, d.body["id"]) for d in delivered) == sorted([(first, 1), (second, 10)])


def test_an_atomic_block_of_the_app_is_joined_without_the_decorator(producer, alias, engine, broker) -> None:
    with transaction.atomic(using=alias):
        insert_order(alias, 5)
        joined = producer.send("order.created", "in the app's atomic block")
        assert committed_ids(engine) == set()  # not committed yet: invisible to another connection
    with pytest.raises(ValueError), transaction.atomic(using=alias):
        producer.send("order.created", "rolled back")
        raise ValueError
    with pytest.raises(qmq.NotInTransaction, match=r"transaction\.atomic"):
        producer.send("order.created", "outside any transaction")
    alone = producer.send_now("order.created", "outside any transaction")  # commits on its own
    assert producer.flush(10)
    assert states(engine) == {joined: "sent", alone: "sent"}
    assert sorted(d.id for d in consume(broker.address, "order.created", 2)) == sorted([joined, alone])


def test_a_transaction_on_another_alias_is_not_the_producers(producer, alias, engine) -> None:
    other = next(a for a in ALIASES if a != alias)
    with pytest.raises(qmq.NotInTransaction, match=f"using='{alias}'"), transaction.atomic(using=other):
        producer.send("order.created", "not in a transaction of the producer's alias")
    assert producer.flush(10)
    assert states(engine) == {}


def test_behind_pgbouncer_the_sender_leaves_nothing_on_the_shared_session(django_dbs, broker) -> None:
    """A producer on an alias that goes through PgBouncer in transaction mode: its sender ships on an
    engine of qmq's own (`engine_for_alias`), which prepares nothing; ordered messages run ordered
    shipping's statements once per send, more often than psycopg's threshold for preparing one."""
    producer = qmq.Producer(brokers=[broker.address], using="bounced")
    engine = create_engine(django_dbs["orders"])  # the same database, directly
    try:
        sent = []
        for n in range(ORDERED_SENDS):
            with transaction.atomic(using="bounced"):
                sent.append(producer.send("order.created", n, order_key="customer-7"))
            assert producer.flush(10)
        assert states(engine) == dict.fromkeys(sent, "sent")  # by the sender: no relay runs
        assert shared_session(django_dbs["bounced"]) == ("on", "0", 0)  # while it holds its connection
    finally:
        producer.close()
        with engine.begin() as conn:
            conn.execute(outbox.delete())
        engine.dispose()


def test_the_senders_connection_takes_the_aliass_connection_options(django_dbs, broker) -> None:
    """The sender connects with `DATABASES[alias]["OPTIONS"]` (TLS settings and the like; here
    `application_name`): while it holds its connection, the alias's name is on Django's connection
    and the sender's (on Django's alone without the options); `close()` closes the sender's."""
    producer = qmq.Producer(brokers=[broker.address], using="orders")
    engine = create_engine(django_dbs["orders"])

    def named() -> int:
        with engine.connect() as conn:
            query = "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND application_name = :n"
            return conn.execute(sa.text(query), {"n": ORDERS_APP_NAME}).scalar()

    try:
        with transaction.atomic(using="orders"):
            message_id = producer.send("order.created", "named")
        assert producer.flush(10)
        assert states(engine) == {message_id: "sent"}
        assert named() == 2
        producer.close()
        wait_until(lambda: named() == 1, "the sender's connection closed", CLOSED_WITHIN_S)
    finally:
        producer.close()
        with engine.begin() as conn:
            conn.execute(outbox.delete())
        engine.dispose()
