"""The shop's test database: SQLite in a temporary directory, made before `shop` is imported."""

from __future__ import annotations

import os
import tempfile

os.environ["SHOP_DB_URL"] = f"sqlite:///{tempfile.mkdtemp()}/shop.sqlite3"

import pytest
import shop

import qmq.testing


@pytest.fixture
def db():
    """Empty tables for each test: the shop's and qmq's (the outbox and the idempotency records)."""
    shop.metadata.drop_all(shop.engine)
    with shop.engine.begin() as conn:
        conn.exec_driver_sql("DROP TABLE IF EXISTS qmq_outbox")
        conn.exec_driver_sql("DROP TABLE IF EXISTS qmq_consumed")
    shop.metadata.create_all(shop.engine)
    qmq.testing.create_tables(shop.engine)
    return shop.engine
