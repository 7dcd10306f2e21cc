"""The reconciliation as operators run it: `spark-submit spark_etl/reconcile.py` (its own Spark, the
master given on the command line) finding a rolled-back transaction's message on a broker (critical,
exit 4), and `qmq reconcile`'s errors, which come before Spark starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

import qmq
from qmq.client import Client
from qmq.db.engine import create_engine
from qmq.ledger import tables as lt
from qmq.store.store import LogStore
from spark_etl import classify as c
from spark_etl.session import JDBC_PACKAGE, jdbc_jar
from tests.support.broker import ROOT, RawConsumer, start_broker
from tests.support.reconcile import classes_of, export_all, read_summary
from tests.support.worker import app_database

SPARK_SUBMIT = Path(sys.executable).parent / "spark-submit"
RUN_TIMEOUT_S = 240


@pytest.fixture
def db_url(pg_url):
    with app_database(pg_url) as url:
        yield url


def test_spark_submit_finds_a_rolled_back_message_critical(processes, tmp_path, db_url) -> None:
    started = datetime.now(UTC) - timedelta(minutes=1)
    broker = start_broker(processes, tmp_path / "b1", name="b1")
    producer = qmq.Producer(brokers=[broker.address], engine=create_engine(db_url))

    @qmq.transactional(producer)
    def place(session) -> str:
        return producer.send("orders", {"n": 1})

    committed = place()
    assert producer.flush(30)
    producer.close()
    database = db_url.rsplit("/", 1)[1]
    with Client(brokers=[broker.address]) as client:
        # What qmq promises never happens: a message its outbox says it produced, with no outbox row.
        ghost = client.send_one("orders", {"n": 2}, headers={lt.PRODUCER_HEADER: f"outbox:{database}"}).message_id
        # An outbox this reconciliation does not read: merely sent outside a transaction, as far as it knows.
        foreign = client.send_one("orders", {"n": 3}, headers={lt.PRODUCER_HEADER: "outbox:elsewhere"}).message_id
    with broker.connect() as conn:
        assert len(RawConsumer(conn, "orders", "billing", "c1", {"start": "earliest"}).drain(3)) == 3
    export_all([broker.data_dir], tmp_path / "ledger")

    out = tmp_path / "out"
    result = subprocess.run(
        [
            str(SPARK_SUBMIT),
            "--master",
            "local[1]",
            "--driver-memory",
            "1g",
            "--conf",
            "spark.ui.enabled=false",
            "--jars",
            str(jdbc_jar()),
            "spark_etl/reconcile.py",
            "--outbox-db",
            db_url,
            "--ledger",
            str(tmp_path / "ledger"),
            "--out",
            str(out),
            "--since",
            started.isoformat(),
            "--until",
            (datetime.now(UTC) + timedelta(minutes=1)).isoformat(),
            "--grace",
            "0s",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env={**os.environ, "PYSPARK_PYTHON": sys.executable, "PYSPARK_DRIVER_PYTHON": sys.executable},
    )
    assert result.returncode == 4, "\n".join(line for line in result.stderr.splitlines() if " INFO " not in line)
    # spark-submit hands the driver's stderr to its stdout too: the summary is the JSON line
    printed = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("{")))
    assert printed["rolled_back"] == 1 and printed["critical"] == 1 and printed["total"] == 3
    assert classes_of(out) == {ghost: c.ROLLED_BACK, foreign: c.ORPHANED}
    assert read_summary(out)["delivered"] == 1 and committed not in classes_of(out)
    assert "**CRITICAL**" in (out / "report.md").read_text()


def qmq_reconcile(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "reconcile", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def test_command_line_errors_come_before_spark(tmp_path) -> None:
    store = LogStore(tmp_path / "store")
    store.close()
    export_all([tmp_path / "store"], tmp_path / "ledger")
    (tmp_path / "empty").mkdir()
    base = ["--ledger", str(tmp_path / "ledger"), "--out", str(tmp_path / "out")]
    pg = ["--outbox-db", "postgresql://postgres@127.0.0.1/postgres"]
    cases = [
        ([*pg, *base], {"QMQ_JDBC_JAR": str(tmp_path / "no.jar")}, 1, JDBC_PACKAGE),
        ([*pg, *base, "--since", "2026-05-02", "--until", "2026-05-01"], None, 2, "must be before --until"),
        (["--outbox-db", "sqlite:///outbox.db", *base], None, 2, "PostgreSQL"),
        ([*pg, "--ledger", str(tmp_path / "empty"), "--out", str(tmp_path / "out")], None, 2, "holds no ledger"),
        ([*pg, *base, "--redrive-dead"], None, 2, "--redrive-dead needs the brokers"),
        ([*pg, *base, "--max-not-acked", "some"], None, 2, "is not a threshold"),
        ([*pg, *base, "--grace", "a while"], None, 2, "is not a duration"),
    ]
    for args, env, code, message in cases:
        result = qmq_reconcile(*args, env=env)
        assert result.returncode == code, (args, result.stderr)
        assert message in result.stderr, (args, result.stderr)
    assert not (tmp_path / "out" / "summary.json").exists()
