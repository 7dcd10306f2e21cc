"""The classification's rules, one message per rule, on small DataFrames in the shared SparkSession
(the end-to-end tests make the same rows with real processes); and the small parts around it:
thresholds, times and durations, database URLs, message-id ranges, the JDBC jar check."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pyspark.sql import functions as F
from pyspark.sql import types as T

from qmq.ids import new_id
from qmq.ledger import tables as lt
from qmq.protocol.ordering import base_subject
from qmq.times import parse_duration, parse_time
from spark_etl import classify as c
from spark_etl.session import JDBC_PACKAGE, JdbcDriverMissing, jdbc_jar
from spark_etl.settings import Threshold
from spark_etl.sources import Database, parse_databases, spark_schema, uuid7_floor
from spark_etl.sources import base_subject as base_subject_column
from tests.support.reconcile import spark  # noqa: F401 - the shared SparkSession fixture

T0 = datetime(2026, 3, 1, tzinfo=UTC)
OUTBOX_SCHEMA = T.StructType(
    [
        T.StructField("message_id", T.StringType()),
        T.StructField("subject", T.StringType()),
        T.StructField("state", T.StringType()),
        T.StructField("attempts", T.IntegerType()),
        T.StructField("created_at", T.TimestampType()),
        T.StructField("sent_at", T.TimestampType()),
        T.StructField("flagged_at", T.TimestampType()),
        T.StructField("deliver_at", T.TimestampType()),
        T.StructField("last_error", T.StringType()),
        T.StructField("database", T.StringType()),
    ]
)
CONSUMED_SCHEMA = T.StructType(
    [
        T.StructField("consumer_group", T.StringType()),
        T.StructField("message_id", T.StringType()),
        T.StructField("subject", T.StringType()),
        T.StructField("consumed_at", T.TimestampType()),
        T.StructField("database", T.StringType()),
    ]
)


def at(hours: float) -> datetime:
    return T0 + timedelta(hours=hours)


class Rows:
    """Rows of each source, written the way the ledger and the outbox would hold them."""

    def __init__(self) -> None:
        self.outbox: list[tuple] = []
        self.tables: dict[str, list[dict[str, Any]]] = {
            t: [] for t in (lt.MESSAGES, lt.DELIVERIES, lt.GROUPS, lt.DELAYED)
        }
        self.consumed: list[tuple] = []

    def committed(
        self,
        mid: str,
        hours: float,
        state: str = "sent",
        *,
        subject: str = "s",
        attempts: int = 1,
        flagged: float | None = None,
        error: str | None = None,
        deliver_at: float | None = None,
    ) -> None:
        self.outbox.append(
            (
                mid,
                subject,
                state,
                attempts,
                at(hours),
                at(hours) if state == "sent" else None,
                at(flagged) if flagged is not None else None,
                at(deliver_at) if deliver_at is not None else None,
                error,
                "shop",
            )
        )

    def stored(
        self, mid: str, hours: float, *, subject: str = "s", producer: str | None = None, broker: str = "b1"
    ) -> None:
        self.tables[lt.MESSAGES].append(
            self._row(
                lt.MESSAGES,
                {
                    "message_id": mid,
                    "subject": subject,
                    "stored_subject": subject,
                    "origin": lt.PRODUCER,
                    "attempt": 1,
                    "stored_at": at(hours),
                    "first_stored_at": at(hours),
                    "created_at": at(hours),
                    "producer": producer,
                    "size": 10,
                    "offset": 0,
                    lt.BROKER: broker,
                },
            )
        )

    def delivered(
        self, mid: str, group: str, status: str, times: int = 1, attempts: int = 1, broadcast: bool = False
    ) -> None:
        self.tables[lt.DELIVERIES].append(
            self._row(
                lt.DELIVERIES,
                {
                    "message_id": mid,
                    "subject": "s",
                    "group": group,
                    "broadcast": broadcast,
                    "times_delivered": times,
                    "status": status,
                    "dead_lettered": status == lt.DEAD_LETTERED,
                    "attempts": attempts,
                    "first_stored_at": T0,
                    lt.BROKER: "b1",
                },
            )
        )

    def group(self, group: str, hours: float, *, subject: str = "s", broadcast: bool = False) -> None:
        self.tables[lt.GROUPS].append(
            self._row(
                lt.GROUPS,
                {"subject": subject, "group": group, "broadcast": broadcast, "created_at": at(hours), lt.BROKER: "b1"},
            )
        )

    def delayed(self, mid: str, due_hours: float, *, dispatched: bool = False, cancelled: bool = False) -> None:
        self.tables[lt.DELAYED].append(
            self._row(
                lt.DELAYED,
                {
                    "message_id": mid,
                    "subject": "s",
                    "stored_at": at(1),
                    "due_at": at(due_hours),
                    "created_at": at(1),
                    "dispatched": dispatched,
                    "cancelled": cancelled,
                    lt.SERVER: "d1",
                },
            )
        )

    @staticmethod
    def _row(table: str, values: dict[str, Any]) -> dict[str, Any]:
        if table in lt.DATED:
            values.setdefault(lt.DATE, T0.strftime("%Y-%m-%d"))
        return {name: values.get(name) for name in spark_schema(table).names}

    def sources(self, session) -> c.Sources:
        frames = {
            t: session.createDataFrame([tuple(r.values()) for r in rows], spark_schema(t))
            for t, rows in self.tables.items()
        }
        return c.Sources(
            outbox=session.createDataFrame(self.outbox, OUTBOX_SCHEMA),
            messages=frames[lt.MESSAGES],
            deliveries=frames[lt.DELIVERIES],
            groups=frames[lt.GROUPS],
            delayed=frames[lt.DELAYED],
            consumed=session.createDataFrame(self.consumed, CONSUMED_SCHEMA),
        )


def test_each_rule_of_the_classification(spark) -> None:  # noqa: F811
    r = Rows()
    r.group("g1", -24)
    r.group("g2", 10)  # created in the middle of the window: not expected of what was stored before
    r.group("retired", -24)
    r.group("watch.bc-1", -24, broadcast=True)
    ids: dict[str, str] = {}

    def message(name: str) -> str:
        ids[name] = new_id()
        return ids[name]

    r.committed(m := message("delivered"), 1)
    r.stored(m, 1)
    r.delivered(m, "g1", lt.ACKED)
    r.delivered(m, "watch.bc-1", lt.IN_FLIGHT, broadcast=True)  # a broadcast consumer is nobody's debt
    r.committed(m := message("after g2"), 11)
    r.stored(m, 11)
    r.delivered(m, "g1", lt.ACKED)  # g2 existed by then, and never got it
    r.committed(m := message("g2 got it anyway"), 1)
    r.stored(m, 1)
    r.delivered(m, "g1", lt.ACKED)
    r.delivered(m, "g2", lt.IN_FLIGHT)
    r.committed(m := message("young, unacked"), 19.5)
    r.stored(m, 19.5)
    r.delivered(m, "g1", lt.IN_FLIGHT)
    r.committed(m := message("young, unshipped"), 19.5, "pending")
    r.committed(message("pending, flagged"), 2, "pending", attempts=7, flagged=3, error="broker down")
    r.committed(message("sent, lost"), 2)
    r.committed(m := message("delayed, not due"), 1, "sent")
    r.delayed(m, 48)
    r.committed(m := message("delayed, overdue"), 1, "sent")
    r.delayed(m, 3)
    r.committed(message("delayed, shipped, not due"), 1, "sent", deliver_at=40)  # no delay server's ledger
    r.committed(message("delayed, stuck in the outbox"), 1, "pending", deliver_at=40)
    r.committed(m := message("delayed, cancelled"), 1, "sent")
    r.delayed(m, 3, cancelled=True)
    r.stored(message("rolled back"), 1, producer="outbox:shop")
    r.stored(m := message("another outbox"), 1, producer="outbox:elsewhere")
    r.delivered(m, "g1", lt.ACKED)
    r.committed(m := message("before the window"), -0.5)
    r.stored(m, -0.4)
    r.stored(message("ledger only, before the window"), -0.4)
    r.committed(m := message("retried"), 1)
    r.stored(m, 1)
    r.delivered(m, "g1", lt.ACKED, times=2, attempts=2)
    r.committed(m := message("handled, ack lost"), 1)
    r.stored(m, 1)
    r.delivered(m, "g1", lt.IN_FLIGHT)
    r.consumed.append(("g1", m, "s", at(1.1), "shop"))
    r.committed(m := message("dead"), 1)
    r.stored(m, 1)
    r.delivered(m, "g1", lt.DEAD_LETTERED, times=3, attempts=3)
    r.committed(m := message("nobody consumes"), 1, subject="lonely")
    r.stored(m, 1, subject="lonely")
    r.committed(m := message("stored twice"), 1)
    r.stored(m, 1)
    r.stored(m, 1.1, broker="b2")
    r.delivered(m, "g1", lt.ACKED, times=1)
    r.tables[lt.DELIVERIES].append({**r.tables[lt.DELIVERIES][-1], lt.BROKER: "b2"})

    window = c.Window(T0, at(24), cutoff=at(19), outbox_names=("shop",), ignore_groups=("retired",))
    sources = r.sources(spark)
    pairs = c.pairs(sources, window)
    classified = c.classify(sources, window, pairs)
    rows = {row["message_id"]: row for row in classified.collect()}
    explained = {
        row["message_id"]: row
        for row in c.explain(classified.where(F.col("class") != c.DELIVERED), pairs, sources, window).collect()
    }
    got = {name: rows[mid]["class"] for name, mid in ids.items() if mid in rows}
    assert got == {
        "delivered": c.DELIVERED,
        "after g2": c.NOT_ACKED,
        "g2 got it anyway": c.NOT_ACKED,
        "young, unacked": c.IN_FLIGHT,
        "young, unshipped": c.IN_FLIGHT,
        "pending, flagged": c.NOT_SHIPPED,
        "sent, lost": c.NOT_SHIPPED,
        "delayed, not due": c.IN_FLIGHT,
        "delayed, overdue": c.NOT_SHIPPED,
        "delayed, cancelled": c.CANCELLED,
        "delayed, shipped, not due": c.IN_FLIGHT,
        "delayed, stuck in the outbox": c.NOT_SHIPPED,
        "rolled back": c.ROLLED_BACK,
        "another outbox": c.ORPHANED,
        "retried": c.REDELIVERED,
        "handled, ack lost": c.NOT_ACKED,
        "dead": c.DEAD_LETTERED,
        "nobody consumes": c.DELIVERED,
        "stored twice": c.REDELIVERED,
    }
    reason = {name: explained[mid]["reason"] for name, mid in ids.items() if mid in explained}
    assert reason["after g2"] == "not acknowledged by g2 (never delivered)"
    assert reason["g2 got it anyway"] == "not acknowledged by g2 (delivered 1x, never acknowledged)"
    assert reason["pending, flagged"] == (
        "pending in shop after 7 attempts: broker down; flagged at 2026-03-01 03:00:00Z"
    )
    assert reason["sent, lost"] == "marked sent in shop at 2026-03-01 02:00:00Z, but no broker stored it"
    assert reason["delayed, not due"] == "due at 2026-03-03 00:00:00Z in d1"
    assert reason["delayed, shipped, not due"] == "due at 2026-03-02 16:00:00Z in a delay server"
    assert reason["delayed, overdue"].endswith("; due at 2026-03-01 03:00:00Z, still in d1")
    assert reason["rolled back"].endswith("produced by outbox:shop: a rolled-back transaction's message")
    assert reason["retried"] == "received more than once by g1 2x (1 after failures)"
    assert reason["handled, ack lost"] == (
        "not acknowledged by g1 (delivered 1x, never acknowledged; handled at 2026-03-01 01:06:00Z, the ack was lost)"
    )
    assert reason["stored twice"] == "received more than once by g1 2x; stored 2 times (on b1, b2)"
    assert reason["young, unshipped"].startswith("made at 2026-03-01 19:30:00Z, within the grace period")
    assert rows[ids["rolled back"]]["critical"] and not rows[ids["dead"]]["critical"]
    assert explained[ids["dead"]]["groups"] == ["g1"] and explained[ids["after g2"]]["groups"] == ["g2"]
    assert explained[ids["stored twice"]]["brokers"] == ["b1", "b2"]
    assert (rows[ids["delivered"]]["groups"], rows[ids["delivered"]]["groups_acked"]) == (1, 1)  # g1 alone
    assert (rows[ids["after g2"]]["groups"], rows[ids["after g2"]]["groups_unacked"]) == (2, 1)


def test_the_subject_behind_a_queue_subject_as_the_protocol_says(spark) -> None:  # noqa: F811
    names = [
        "orders#7",
        "orders#63",
        "orders#64",
        "orders#0007",
        "orders#",
        "a.b-c#0",
        "#3",
        "x#y#3",
        "%DEAD%o#1%g",
        "plain",
    ]
    frame = spark.createDataFrame([(n,) for n in names], "stored string")
    got = {
        r["stored"]: r["subject"]
        for r in frame.select("stored", base_subject_column(F.col("stored")).alias("subject")).collect()
    }
    assert got == {n: base_subject(n) for n in names}
    assert got["orders#7"] == "orders" and got["orders#64"] == "orders#64"


def test_thresholds() -> None:
    assert Threshold.parse("0").exceeded(1, 1000) and not Threshold.parse("0").exceeded(0, 1000)
    assert not Threshold.parse("5").exceeded(5, 10) and Threshold.parse("5").exceeded(6, 10)
    assert not Threshold.parse("0.1%").exceeded(10, 10_000) and Threshold.parse("0.1%").exceeded(11, 10_000)
    assert str(Threshold.parse("0.5%")) == "0.5%" and str(Threshold.parse("3")) == "3"
    for bad in ("-1", "1.5", "ten", "5%%"):
        with pytest.raises(ValueError, match=r"threshold|whole number"):
            Threshold.parse(bad)


def test_times_and_durations() -> None:
    now = datetime(2026, 5, 7, 13, 45, tzinfo=UTC)
    assert parse_time("yesterday", now) == datetime(2026, 5, 6, tzinfo=UTC)
    assert parse_time("today", now) == datetime(2026, 5, 7, tzinfo=UTC)
    assert parse_time("2026-05-01", now) == datetime(2026, 5, 1, tzinfo=UTC)
    assert parse_time("2026-05-01T02:00+02:00", now) == datetime(2026, 5, 1, tzinfo=UTC)
    assert parse_duration("1h30m") == timedelta(minutes=90) and parse_duration("45") == timedelta(seconds=45)
    assert parse_duration("500ms") == timedelta(milliseconds=500) and parse_duration("2d") == timedelta(days=2)
    with pytest.raises(ValueError, match="is not a time"):
        parse_time("last tuesday")
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration("15 minutes")


def test_database_urls_and_message_id_ranges() -> None:
    db = Database.parse("postgresql://app:secret@db.internal:6432/shop?sslmode=require")
    assert db.name == "shop" and db.jdbc_url == "jdbc:postgresql://db.internal:6432/shop?sslmode=require"
    assert db.properties["user"] == "app" and db.properties["password"] == "secret" and "secret" not in repr(db)
    twins = parse_databases(["postgresql://a@h1/shop", "postgresql://a@h2/shop", "postgresql://a@h1/shop"])
    assert [d.name for d in twins] == ["h1:5432/shop", "h2:5432/shop"]
    with pytest.raises(ValueError, match="PostgreSQL"):
        Database.parse("sqlite:///outbox.db")
    before = datetime.now(UTC) - timedelta(milliseconds=5)
    made = new_id()
    after = datetime.now(UTC) + timedelta(milliseconds=5)
    assert uuid7_floor(before) <= made < uuid7_floor(after)


def test_a_missing_jdbc_jar_names_the_package(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("QMQ_JDBC_JAR", str(tmp_path / "postgresql.jar"))
    with pytest.raises(JdbcDriverMissing, match=JDBC_PACKAGE):
        jdbc_jar()
