"""Reading the three sources of a reconciliation into DataFrames: the outbox tables (JDBC), the
broker ledger (Parquet, docs/reconcile.md) and the consumers' idempotency tables (JDBC).

Outbox reads are bounded to the window without an index on `created_at`: message ids are UUIDv7,
time-ordered strings, so the window is a range of the unique `message_id` index; its first and last
rows give the `id` bounds of a partitioned read (the bounds only set the stride; the range condition
is what filters). Every source may be several databases: rows carry the database's name.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T
from sqlalchemy.engine import make_url

from qmq.ledger import tables as lt
from qmq.outbox.schema import outbox as outbox_table
from qmq.protocol.ordering import ORDERED_QUEUES, QUEUE_SUBJECT_RE
from spark_etl.session import JDBC_DRIVER_CLASS
from worker.schema import consumed as consumed_table

POSTGRESQL_DRIVERS = ("postgresql", "postgres")
FETCH_ROWS = 10_000  # rows per round trip; pgJDBC streams only with a fetch size
ROWS_PER_JDBC_PARTITION = 1_000_000
OUTBOX_COLUMNS = (
    "id",
    "message_id",
    "subject",
    "state",
    "attempts",
    "created_at",
    "sent_at",
    "flagged_at",
    "deliver_at",
    "last_error",
)


@dataclass(frozen=True)
class Database:
    """A PostgreSQL database given as a URL, as JDBC wants it; `name` labels its rows."""

    name: str
    jdbc_url: str
    properties: dict[str, str] = field(repr=False)
    url: str = field(repr=False, default="")  # as given (for writes through SQLAlchemy)

    @classmethod
    def parse(cls, url: str) -> Database:
        try:
            parsed = make_url(url)
        except Exception:
            raise ValueError(f"{url!r} is not a database URL (postgresql://user:password@host:5432/name)") from None
        if parsed.drivername.split("+")[0] not in POSTGRESQL_DRIVERS:
            raise ValueError(
                f"{parsed.render_as_string(hide_password=True)}: the reconciliation reads PostgreSQL "
                f"databases (postgresql://...) through JDBC"
            )
        if not parsed.database:
            raise ValueError(f"{parsed.render_as_string(hide_password=True)} names no database")
        query = "&".join(f"{k}={v}" for k, v in parsed.query.items() if isinstance(v, str))
        jdbc = f"jdbc:postgresql://{parsed.host or 'localhost'}:{parsed.port or 5432}/{parsed.database}"
        properties = {"driver": JDBC_DRIVER_CLASS, "user": parsed.username or "", "password": parsed.password or ""}
        return cls(parsed.database, jdbc + (f"?{query}" if query else ""), properties, url)


def parse_databases(urls: list[str]) -> list[Database]:
    """Each URL once; databases of the same name on different servers are told apart by server."""
    found = list({db.jdbc_url: db for db in map(Database.parse, urls)}.values())
    names = [db.name for db in found]
    return [
        db if names.count(db.name) == 1 else replace(db, name=db.jdbc_url.split("//", 1)[1].split("?")[0])
        for db in found
    ]


def uuid7_floor(moment: datetime) -> str:
    """The smallest UUIDv7 string of `moment`'s millisecond: ids made from then on sort at or after it."""
    h = f"{int(moment.timestamp() * 1000):012x}"
    return f"{h[:8]}-{h[8:12]}-7000-8000-000000000000"


def _sql_time(moment: datetime) -> str:
    return f"TIMESTAMPTZ '{moment.isoformat()}'"


def _jdbc(spark: SparkSession, db: Database):
    reader = spark.read.format("jdbc").option("url", db.jdbc_url).option("fetchsize", FETCH_ROWS)
    for key, value in db.properties.items():
        reader = reader.option(key, value)
    return reader


def read_outbox(
    spark: SparkSession, dbs: list[Database], since: datetime, until: datetime, max_partitions: int
) -> DataFrame:
    """The outbox rows whose message id was made in [since, until), from every database."""
    frames = [_read_one_outbox(spark, db, since, until, max_partitions) for db in dbs]
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out


def _read_one_outbox(
    spark: SparkSession, db: Database, since: datetime, until: datetime, max_partitions: int
) -> DataFrame:
    table = outbox_table.name
    in_range = f"message_id >= '{uuid7_floor(since)}' AND message_id < '{uuid7_floor(until)}'"
    bounds = (
        _jdbc(spark, db)
        .option(
            "query",
            (
                f"SELECT (SELECT id FROM {table} WHERE {in_range} ORDER BY message_id LIMIT 1) AS first_id, "
                f"(SELECT id FROM {table} WHERE {in_range} ORDER BY message_id DESC LIMIT 1) AS last_id"
            ),
        )
        .load()
        .first()
    )
    window = f"(SELECT {', '.join(OUTBOX_COLUMNS)} FROM {table} WHERE {in_range}) AS outbox_window"
    reader = _jdbc(spark, db).option("dbtable", window)
    if bounds is not None and bounds.first_id is not None:
        low, high = sorted((bounds.first_id, bounds.last_id))
        partitions = max(1, min(max_partitions, math.ceil((high - low + 1) / ROWS_PER_JDBC_PARTITION)))
        if partitions > 1:
            reader = (
                reader.option("partitionColumn", "id")
                .option("lowerBound", low)
                .option("upperBound", high + 1)
                .option("numPartitions", partitions)
            )
    return reader.load().drop("id").withColumn("database", F.lit(db.name))


def read_consumed(spark: SparkSession, dbs: list[Database], since: datetime) -> DataFrame | None:
    """Idempotency records made since `since`, from every database; None when none was given."""
    frames = []
    for db in dbs:
        query = (
            f"(SELECT consumer_group, message_id, subject, consumed_at FROM {consumed_table.name} "
            f"WHERE consumed_at >= {_sql_time(since)}) AS consumed_window"
        )
        frames.append(_jdbc(spark, db).option("dbtable", query).load().withColumn("database", F.lit(db.name)))
    if not frames:
        return None
    out = frames[0]
    for frame in frames[1:]:
        out = out.unionByName(frame)
    return out


# ---- the ledger ------------------------------------------------------------------------------------

_SPARK_TYPES = {
    pa.string(): T.StringType(),
    pa.int32(): T.IntegerType(),
    pa.int64(): T.LongType(),
    pa.bool_(): T.BooleanType(),
    lt.TS: T.TimestampType(),
}


def spark_schema(table: str) -> T.StructType:
    fields = [T.StructField(f.name, _SPARK_TYPES[f.type]) for f in lt.SCHEMAS[table]]
    if table in lt.DATED:
        fields.append(T.StructField(lt.DATE, T.StringType()))
    fields.append(T.StructField(lt.PARTITION_OF[table], T.StringType()))
    return T.StructType(fields)


def base_subject(stored: Column) -> Column:
    """The producer's subject behind a queue subject (`orders#7` -> `orders`), others unchanged: as
    qmq.protocol.ordering.base_subject, in Spark. A broker stores an ordered message under its queue
    subject, while its outbox row and its idempotency record name the subject."""
    pattern = f"^{QUEUE_SUBJECT_RE.pattern}$"
    queue = F.regexp_extract(stored, pattern, 2)
    is_queue = stored.rlike(pattern) & (queue.cast("int") < ORDERED_QUEUES)
    return F.when(is_queue, F.regexp_extract(stored, pattern, 1)).otherwise(stored)


STORED_COLUMN = {lt.MESSAGES: "first_stored_at", lt.DELIVERIES: "first_stored_at", lt.DELAYED: "stored_at"}


def read_ledger_table(spark: SparkSession, ledger: Path, table: str, not_before: datetime | None = None) -> DataFrame:
    """One table of the ledger, with its partition columns; only messages first stored from
    `not_before` on (whole days are skipped unread). Empty when no store wrote the table. `subject`
    is the producer's subject, an ordered message's queue aside (a message's `stored_subject` keeps it)."""
    path = ledger / table
    if not path.is_dir() or not any(path.rglob("*.parquet")):
        return spark.createDataFrame([], spark_schema(table))
    frame = spark.read.schema(spark_schema(table)).option("basePath", str(path)).parquet(str(path))
    if not_before is not None and table in lt.DATED:
        frame = frame.where(
            (F.col(lt.DATE) >= not_before.astimezone(UTC).strftime("%Y-%m-%d"))
            & (F.col(STORED_COLUMN[table]) >= F.lit(not_before))
        )
    return frame.withColumn("subject", base_subject(F.col("subject")))


@dataclass
class LedgerExports:
    """The stores exported into a ledger, and the moment up to which the ledger is complete."""

    stores: list[dict[str, Any]]
    as_of: datetime

    @classmethod
    def read(cls, ledger: Path, since: datetime) -> LedgerExports:
        """ValueError when no store was ever exported there."""
        directory = ledger / lt.EXPORTS_DIR
        stores = [json.loads(p.read_text()) for p in sorted(directory.glob("*.json"))] if directory.is_dir() else []
        if not stores:
            raise ValueError(f"{ledger} holds no ledger: run `qmq ledger export --out {ledger}` for each broker")
        for store in stores:
            store["stale"] = store["as_of_ms"] < since.timestamp() * 1000
        current = [s["as_of_ms"] for s in stores if not s["stale"]] or [s["as_of_ms"] for s in stores]
        return cls(stores, datetime.fromtimestamp(min(current) / 1000, tz=since.tzinfo))
