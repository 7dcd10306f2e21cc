"""The Django path of docs/django.md, as real processes on PostgreSQL: `manage.py migrate` makes the
shop's tables and both of qmq's; orders placed with `@qmq.transactional` or inside an `atomic` block
are delivered once, a rolled-back one never; `qmq worker` runs the idempotent billing handler, which
uses the ORM, in one `atomic` block with its idempotency record, and skips a duplicate."""

from __future__ import annotations

import os
import subprocess
import sys

import psycopg

from qmq.client import Client, OutgoingMessage
from tests.support.broker import ROOT, start_broker
from tests.support.databases import fresh_database
from tests.support.worker import wait_ready
from tests.test_meta import log_text, start_meta, wait_until

PRODUCE = """
import django
django.setup()
from tests.apps.django_shop.shop.orders import place_order, place_order_in_a_view, producer
ids = [place_order("book")]
try:
    place_order("unavailable")
except LookupError:
    pass
ids.append(place_order_in_a_view("pen"))
assert producer.flush(30)
print(" ".join(ids))
"""


def rows(db: str, sql: str) -> list[tuple]:
    with psycopg.connect(db) as conn:
        return conn.execute(sql).fetchall()


def test_from_migrate_to_an_idempotent_handler_using_the_orm(processes, pg_url, tmp_path) -> None:
    with fresh_database(pg_url) as db:
        _, meta_port = start_meta(processes, f"sqlite:///{tmp_path / 'meta.sqlite3'}")
        meta = f"127.0.0.1:{meta_port}"
        start_broker(processes, tmp_path / "broker", "--meta", meta, "--group", "shop")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "DJANGO_SETTINGS_MODULE": "tests.apps.django_shop.settings",
            "SHOP_DB_URL": db,
            "QMQ_META": meta,
            "QMQ_TOKEN": "",
        }

        def run(*args: str) -> str:
            done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
            return done.stdout

        run(sys.executable, "tests/apps/django_shop/manage.py", "migrate", "-v", "0")
        tables = {r[0] for r in rows(db, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
        assert tables >= {"qmq_outbox", "qmq_consumed", "shop_order", "shop_invoice"}

        worker = processes.start(
            ["-m", "qmq", "worker", "-A", "tests.apps.django_shop.consumers:app", "-l", "INFO", "-n", "billing"],
            name="worker",
            env=env,
        )
        wait_ready(worker)
        book, pen = run(sys.executable, "-c", PRODUCE).split()

        def invoices() -> list[int]:
            return sorted(r[0] for r in rows(db, "SELECT order_id FROM shop_invoice"))

        orders = sorted(r[0] for r in rows(db, "SELECT id FROM shop_order"))
        assert len(orders) == 2  # the unavailable one rolled back
        wait_until(lambda: invoices() == orders, "both orders invoiced")
        consumed = {r[0] for r in rows(db, "SELECT message_id FROM qmq_consumed WHERE consumer_group = 'billing'")}
        assert consumed == {book, pen}

        with Client(meta=meta) as client:  # the same message again: absorbed by the idempotency record
            [result] = client.send([OutgoingMessage("order.created", {"id": orders[0]}, id=book)])
            assert result.ok, result.error
        wait_until(lambda: f"{book} attempt 1: already consumed, skipped" in log_text(worker), "the duplicate skipped")
        assert invoices() == orders
