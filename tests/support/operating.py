"""The cluster an operator looks at in the operating tests (`qmq admin`, `qmq console`): a meta server,
a broker group, a delay server and a worker of tests/apps/billing.py, all with a token, over the
app's own PostgreSQL database; and the shop side that places orders through the outbox."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from sqlalchemy.orm import Session

import qmq
from qmq.db.engine import create_engine
from qmq.db.migrate import upgrade
from tests.apps.billing_schema import TABLES
from tests.support.broker import ROOT
from tests.support.databases import fresh_database
from tests.support.processes import free_port, wait_for_port
from tests.support.worker import wait_ready

TOKEN = "s3cret-operator-token"
BILLING = "tests.apps.billing:app"


@dataclass
class OperatedCluster:
    meta: str
    broker: str
    delay: str
    db_url: str
    worker: Any
    env: dict[str, str]  # what a client process needs: QMQ_META and QMQ_TOKEN
    processes: Any

    def start_worker(self, subject: str, name: str, concurrency: int = 4) -> Any:
        """A worker of the billing app for `subject` only; returns once it is ready."""
        worker = self.processes.start(
            ["-m", "qmq", "worker", "-A", BILLING, "-l", "INFO", "-n", name, "-c", str(concurrency), "-Q", subject],
            name=name.split("@")[0],
            env={"PYTHONPATH": str(ROOT), **self.env, "QMQ_TEST_DB": self.db_url},
        )
        wait_ready(worker)
        return worker

    def place_order(self, order_id: int, customer: int) -> str:
        """The shop's transaction: an order row... and its order.created message, through the outbox."""
        engine = create_engine(self.db_url)
        producer = qmq.Producer(meta=self.meta, engine=engine, token=TOKEN)

        @qmq.transactional(producer)
        def place(session: Session) -> str:
            return producer.send("order.created", {"order": order_id, "customer": customer}, key=str(order_id))

        try:
            return place()
        finally:
            producer.close()
            engine.dispose()

    def open_account(self, customer: int, account: str) -> None:
        with psycopg.connect(self.db_url, autocommit=True) as conn:
            conn.execute("INSERT INTO billing_accounts (customer, account) VALUES (%s, %s)", (customer, account))

    def invoices(self) -> list[tuple[int, str]]:
        with psycopg.connect(self.db_url) as conn:
            return [tuple(r) for r in conn.execute("SELECT order_id, account FROM invoices ORDER BY order_id")]


@contextlib.contextmanager
def operated_cluster(processes, pg_url: str, data_dir: Path) -> Iterator[OperatedCluster]:
    env = {"PYTHONPATH": str(ROOT), "QMQ_TOKEN": TOKEN, "QMQ_META": ""}
    meta_port, broker_port, delay_port = free_port(), free_port(), free_port()
    meta = f"127.0.0.1:{meta_port}"
    with fresh_database(pg_url) as db_url:
        upgrade(db_url)
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute(TABLES)

        def start(name: str, port: int, *args: str) -> None:
            """`qmq NAME --port PORT ARGS` with the cluster's token, once it listens."""
            proc = processes.start(["-m", "qmq", name, "--port", str(port), *args], name=name, env=env)
            wait_for_port(port, proc)

        start("meta", meta_port, "--db", f"sqlite:///{data_dir / 'meta.sqlite3'}")
        start("broker", broker_port, "--data-dir", str(data_dir / "broker"), "--meta", meta, "--group", "main")
        start("delay-server", delay_port, "--data-dir", str(data_dir / "delay"), "--meta", meta)
        cluster = OperatedCluster(
            meta,
            f"127.0.0.1:{broker_port}",
            f"127.0.0.1:{delay_port}",
            db_url,
            None,
            {"QMQ_META": meta, "QMQ_TOKEN": TOKEN},
            processes,
        )
        cluster.worker = cluster.start_worker("order.created", "billing@%h")
        yield cluster
