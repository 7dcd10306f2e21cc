"""The outbox table as the migrations make it, on SQLite and PostgreSQL: defaults from the database,
one row per message id, only known states, and the relay's partial index."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from qmq.outbox.schema import outbox
from tests.support.databases import fresh_database, migrated_engine


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path):
    with migrated_engine(request.param, request, tmp_path, "outbox.sqlite3") as engine:
        yield engine


def row(message_id: str, **values) -> dict:
    return {
        "message_id": message_id,
        "subject": "order.created",
        "body": b"{}",
        "content_type": "application/json",
        **values,
    }


def test_a_new_row_is_pending_with_database_times(engine) -> None:
    with engine.begin() as conn:
        conn.execute(outbox.insert().values(row("m1", tags=["new"], headers={"trace": "t1"})))
        r = conn.execute(sa.select(outbox)).one()
    assert (r.state, r.attempts, r.tags, r.headers) == ("pending", 0, ["new"], {"trace": "t1"})
    assert r.created_at is not None and r.next_attempt_at is not None
    assert r.sent_at is None and r.lease_token is None


def test_one_row_per_message_id_and_only_known_states(engine) -> None:
    with engine.begin() as conn:
        conn.execute(outbox.insert().values(row("m1")))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(outbox.insert().values(row("m1")))
    with pytest.raises(sa.exc.IntegrityError), engine.begin() as conn:
        conn.execute(outbox.insert().values(row("m2", state="lost")))


def test_the_pending_index_is_partial(engine) -> None:
    if engine.dialect.name == "postgresql":
        query = "SELECT indexdef FROM pg_indexes WHERE indexname = 'ix_qmq_outbox_pending'"
    else:
        query = "SELECT sql FROM sqlite_master WHERE name = 'ix_qmq_outbox_pending'"
    with engine.connect() as conn:
        definition = conn.execute(sa.text(query)).scalar_one()
    assert "WHERE" in definition.upper() and "pending" in definition


def test_postgresql_pages_keep_room_for_hot_claims(pg_url) -> None:
    with fresh_database(pg_url) as url:
        upgrade(url)
        engine = create_engine(url)
        with engine.connect() as conn:
            options = conn.execute(sa.text("SELECT reloptions FROM pg_class WHERE relname = 'qmq_outbox'")).scalar()
        engine.dispose()
    assert options == ["fillfactor=70"]
