"""The producer and `qmq relay --no-listen` behind PgBouncer in transaction mode (a real PgBouncer,
tests/support/pgbouncer.py).

There, consecutive transactions of one client connection may run on different server connections,
and one server connection serves every client in turn: whatever a client leaves on the session (a
SET, a named prepared statement) reaches the others' transactions, or is missing from its own next
one. The after-commit sender ships on a connection of the application's engine, so it must leave
nothing: its settings are its transactions' own (`set_config(..., true)` in its statements) and its
statements are not prepared (qmq/outbox/rows.py). Before, it SET `synchronous_commit = off` on the
session: behind PgBouncer every other client's commits stopped waiting for the WAL flush.
"""

from __future__ import annotations

import psycopg
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

import qmq
from qmq.db.migrate import upgrade
from tests.support.databases import fresh_database
from tests.support.outbox import consume, states
from tests.support.pgbouncer import shared_session, start_pgbouncer
from tests.support.waiting import wait_until

MESSAGES = 30
ORDERED = 6  # of them, in one key (shipped by ordered shipping, its own transactions)
WAVES = 6  # the relay's test sends its messages in waves, each shipped before the next is sent
SHIPPED_WITHIN_S = 30.0

orders = sa.Table("orders", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))


@pytest.fixture
def through_pgbouncer(processes, tmp_path, pg_url):
    """(direct URL, URL through PgBouncer) of a fresh database with qmq's tables and an orders table."""
    with fresh_database(pg_url) as url:
        upgrade(url)
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("CREATE TABLE orders (id integer PRIMARY KEY)")
        server = psycopg.conninfo.conninfo_to_dict(url)
        port = start_pgbouncer(processes, tmp_path / "pgbouncer", server["host"], int(server.get("port", 5432)))
        yield url, f"postgresql+psycopg://postgres@127.0.0.1:{port}/{server['dbname']}"


def test_the_after_commit_sender_behind_pgbouncer_ships_everything_and_leaves_nothing_on_the_session(
    through_pgbouncer, broker
) -> None:
    direct, bounced = through_pgbouncer
    # As psycopg's documentation says for PgBouncer in transaction mode: no automatic prepares.
    engine = sa.create_engine(bounced, connect_args={"prepare_threshold": None})
    producer = qmq.Producer(brokers=[broker.address], engine=engine)

    @qmq.transactional(producer)
    def place_order(session: Session, order_id: int) -> str:
        session.execute(orders.insert().values(id=order_id))
        order_key = "customer-1" if order_id < ORDERED else None
        return producer.send("order.placed", {"order": order_id}, order_key=order_key)

    try:
        sent = [place_order(order_id=i) for i in range(MESSAGES)]
        assert producer.flush(10)
        # No relay runs: every row marked sent was shipped by the after-commit sender, through PgBouncer.
        direct_engine = sa.create_engine(direct.replace("postgresql://", "postgresql+psycopg://"))
        try:
            assert states(direct_engine) == dict.fromkeys(sent, "sent")
        finally:
            direct_engine.dispose()
        # The sender still holds its connection; the server connection under it is everyone's.
        assert shared_session(bounced) == ("on", "0", 0)
    finally:
        producer.close()
        engine.dispose()
    # The unordered ones on the subject (the ordered ones are on their key's queue, docs/ordering.md).
    delivered = consume(broker.address, "order.placed", MESSAGES - ORDERED)
    assert sorted(d.id for d in delivered) == sorted(sent[ORDERED:])


def test_the_relay_behind_pgbouncer_polls_ships_everything_and_leaves_nothing_on_the_session(
    through_pgbouncer, broker, processes
) -> None:
    """`qmq relay --no-listen` through PgBouncer: no LISTEN (session state), nothing prepared on its
    connections, the shipping settings its transactions' own; it finds the rows by polling."""
    direct, bounced = through_pgbouncer
    direct_engine = sa.create_engine(direct.replace("postgresql://", "postgresql+psycopg://"))
    producer = qmq.Producer(brokers=[broker.address], engine=direct_engine, after_commit=False)
    relay = processes.start(
        ["-m", "qmq", "relay", "--db", bounced, "--broker", broker.address, "--no-listen", "--poll-interval", "0.1"],
        name="relay",
    )
    try:
        sent: list[str] = []
        for wave in range(WAVES):  # each found by a poll: the relay's statements run many times
            wave_ids = [producer.send_now("order.placed", {"wave": wave, "n": n}) for n in range(MESSAGES // WAVES)]
            wait_until(
                lambda ids=wave_ids: {states(direct_engine).get(i) for i in ids} == {"sent"},
                f"wave {wave} shipped",
                SHIPPED_WITHIN_S,
            )
            sent += wave_ids
        assert relay.poll() is None, "the relay exited"
        assert shared_session(bounced) == ("on", "0", 0)  # the relay still holds its connections
    finally:
        producer.close()
        direct_engine.dispose()
    delivered = consume(broker.address, "order.placed", len(sent))
    assert sorted(d.id for d in delivered) == sorted(sent)
