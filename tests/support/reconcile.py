"""Helpers for the ledger and reconciliation tests: reading a ledger or a reconciliation's output
back with pyarrow (independently of Spark), and the one SparkSession the tests share."""

from __future__ import annotations

import atexit
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from qmq.ledger import tables as t


def read_ledger(out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every table of the ledger at `out` as rows, with their partition columns (date, broker or
    server) as strings; a table with no file yet is []."""
    tables = {}
    for table in (t.MESSAGES, t.DELIVERIES, t.GROUPS, t.DELAYED):
        path = out / table
        if not path.is_dir() or not any(path.rglob("*.parquet")):
            tables[table] = []
            continue
        data = ds.dataset(
            path, format="parquet", partitioning=ds.partitioning(flavor="hive"), ignore_prefixes=[".", "_"]
        ).to_table()
        rows = data.to_pylist()
        for row in rows:
            for column in (t.DATE, t.BROKER, t.SERVER):
                if column in row:
                    row[column] = str(row[column])
        tables[table] = rows
    return tables


def read_summary(out: Path) -> dict[str, Any]:
    return json.loads((out / "summary.json").read_text())


def read_anomalies(out: Path) -> list[dict[str, Any]]:
    return pq.read_table(out / "anomalies").to_pylist()


def classes_of(out: Path) -> dict[str, str]:
    """message id -> class of every anomaly a reconciliation wrote."""
    return {row["message_id"]: row["class"] for row in read_anomalies(out)}


# ---- the one SparkSession of the test run ------------------------------------------------------------

SPARK_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.ui.enabled": "false",
    "spark.driver.memory": "1g",
    "spark.sql.adaptive.coalescePartitions.initialPartitionNum": "2",
}
_session = None


@pytest.fixture(scope="session")
def spark():
    """The SparkSession every reconciliation test shares (local[2]): starting one takes seconds. Made
    on first use, stopped when the test run ends."""
    global _session
    if _session is None:
        from spark_etl.session import spark_session

        _session = spark_session("local[2]", conf=SPARK_CONF)
        atexit.register(_session.stop)
    return _session


def reconcile(spark, out: Path, outbox_dbs: list[str], ledger: Path, since: datetime, until: datetime, **settings: Any):
    """Run a reconciliation in this process's SparkSession; its findings."""
    from spark_etl.job import run
    from spark_etl.settings import Settings

    return run(spark, Settings(outbox_dbs=outbox_dbs, ledger=ledger, out=out, since=since, until=until, **settings))


def export_all(stores: list[Path], ledger: Path) -> None:
    """`qmq ledger export` of each store into one ledger (in this process: the command itself is
    tested in test_ledger.py)."""
    from qmq.cli.ledger import export_store

    for store in stores:
        report = export_store(store, ledger)
        assert not report.problems, report.problems
