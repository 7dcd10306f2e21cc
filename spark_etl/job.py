"""One reconciliation run: read the sources, classify every message of the window, write the
classification and the anomalies (Parquet), repair if asked, and write the summary and the report.

The classification is written once (`classified/`) and every figure is read back from it, so the
outbox tables are read once however many figures the report has.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import time
from collections.abc import Iterator
from datetime import UTC, datetime

from pyspark.sql import SparkSession, Window
from pyspark.sql import functions as F

from qmq.ledger import tables as lt
from qmq.ledger.replay import parse_system_subject
from spark_etl import classify as c
from spark_etl import redrive as repairs
from spark_etl.classify import ANOMALIES, CRITICAL, DEAD_LETTERED, NOT_ACKED, NOT_SHIPPED, Sources
from spark_etl.report import ANOMALIES_DIR, CLASSIFIED_DIR, EXAMPLES_PER_CLASS, PAIRS_DIR, Findings, write_all
from spark_etl.settings import Settings
from spark_etl.sources import (
    LedgerExports,
    parse_databases,
    read_consumed,
    read_ledger_table,
    read_outbox,
)

log = logging.getLogger("qmq.reconcile")

ONE_FILE_BELOW_ROWS = 1_000_000  # anomalies written as one Parquet file when fewer than this


@contextlib.contextmanager
def _step(what: str) -> Iterator[None]:
    """Log how long a step took (INFO): where the night's minutes go."""
    started = time.monotonic()
    yield
    log.info("%s: %.1f s", what, time.monotonic() - started)


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def run(spark: SparkSession, settings: Settings) -> Findings:
    """Reconcile; the findings (also written to `settings.out`). ValueError for bad settings or a
    directory that holds no ledger."""
    settings.check()
    outbox_dbs = parse_databases(settings.outbox_dbs)
    consumed_dbs = parse_databases(settings.consumed_dbs)
    exports = LedgerExports.read(settings.ledger, settings.since)
    cutoff = exports.as_of - settings.grace
    since, until, skew = settings.since, settings.until, settings.skew
    with _step("found the outbox window's bounds"):
        outbox = read_outbox(spark, outbox_dbs, since - skew, until + skew, settings.jdbc_partitions)
    src = Sources(
        outbox=outbox,
        # A message is stored after it is made, give or take the clocks.
        messages=read_ledger_table(spark, settings.ledger, lt.MESSAGES, since - skew),
        deliveries=read_ledger_table(spark, settings.ledger, lt.DELIVERIES, since - skew),
        groups=read_ledger_table(spark, settings.ledger, lt.GROUPS),
        delayed=read_ledger_table(spark, settings.ledger, lt.DELAYED, since - skew),
        consumed=read_consumed(spark, consumed_dbs, since - skew),
    )
    window = c.Window(since, until, cutoff, tuple(db.name for db in outbox_dbs), tuple(settings.ignore_groups))
    out = settings.out
    out.mkdir(parents=True, exist_ok=True)
    with _step("paired messages with their consumer groups"):
        c.pairs(src, window).write.mode("overwrite").parquet(str(out / PAIRS_DIR))
    pairs = spark.read.parquet(str(out / PAIRS_DIR))
    with _step("read and classified the window"):
        c.classify(src, window, pairs).write.mode("overwrite").parquet(str(out / CLASSIFIED_DIR))
    classified = spark.read.parquet(str(out / CLASSIFIED_DIR))
    per_subject: dict[str, dict[str, int]] = {}
    counts: dict[str, int] = {}
    with _step("counted"):
        for row in classified.groupBy("subject", "class").count().collect():
            per_subject.setdefault(row["subject"] or "", {})[row["class"]] = row["count"]
            counts[row["class"]] = counts.get(row["class"], 0) + row["count"]
    found = sum(counts.get(cls, 0) for cls in ANOMALIES)
    with _step("explained the anomalies"):
        explained = c.explain(classified.where(F.col("class").isin(*ANOMALIES)), pairs, src, window)
        shutil.rmtree(out / ANOMALIES_DIR, ignore_errors=True)
        (explained.repartition(1) if found < ONE_FILE_BELOW_ROWS else explained).write.parquet(str(out / ANOMALIES_DIR))
    anomalies = spark.read.parquet(str(out / ANOMALIES_DIR))
    with _step("per group and examples"):
        per_group = [row.asDict() for row in c.per_group(pairs, classified).orderBy("subject", "group").collect()]
        examples = _examples(anomalies)
    findings = Findings(
        window={
            "since": _iso(since),
            "until": _iso(until),
            "as_of": _iso(exports.as_of),
            "grace_s": settings.grace.total_seconds(),
            "cutoff": _iso(cutoff),
        },
        sources={
            "outbox": [db.name for db in outbox_dbs],
            "consumed": [db.name for db in consumed_dbs],
            "ledger": str(settings.ledger),
            "stores": [{k: s.get(k) for k in ("name", "kind", "as_of", "stale")} for s in exports.stores],
            "ignored_groups": list(settings.ignore_groups),
        },
        counts=counts,
        per_subject=per_subject,
        per_group=per_group,
        examples=examples,
        thresholds={NOT_SHIPPED: str(settings.max_not_shipped), NOT_ACKED: str(settings.max_not_acked)},
    )
    total = findings.total
    findings.exceeded = [
        cls
        for cls, threshold in ((NOT_SHIPPED, settings.max_not_shipped), (NOT_ACKED, settings.max_not_acked))
        if threshold.exceeded(counts.get(cls, 0), total)
    ]
    if settings.redrive or settings.redrive_dead:
        findings.redrive = _repair(settings, outbox_dbs, anomalies, src.messages)
    with _step("wrote the report"):
        write_all(out, findings)
    if counts.get(CRITICAL[0]):
        log.critical("%d messages of rolled-back transactions were found on brokers", counts[CRITICAL[0]])
    return findings


def _examples(anomalies) -> dict[str, list[dict]]:
    """The first anomalies of each class by message id, in one pass."""
    first = Window.partitionBy("class").orderBy("message_id")
    rows = (
        anomalies.select("class", "message_id", "subject", "groups", "reason")
        .withColumn("n", F.row_number().over(first))
        .where(F.col("n") <= EXAMPLES_PER_CLASS)
        .orderBy("class", "message_id")
        .collect()
    )
    examples: dict[str, list[dict]] = {}
    for row in rows:
        examples.setdefault(row["class"], []).append({k: row[k] for k in ("message_id", "subject", "groups", "reason")})
    return examples


def _dead_letter_pairs(anomalies, messages) -> list[tuple[str, str]]:
    """(stored subject, group) of the dead letters of the dead-lettered anomalies, as brokers name
    them: an ordered message's dead letter is under its queue subject `subject#queue`, which the
    classification reads as `subject` (spark_etl/sources.py)."""
    dead = anomalies.where(F.col("class") == DEAD_LETTERED).select("message_id", F.explode("groups").alias("group"))
    copies = messages.where(F.col("origin") == lt.DEAD).join(dead, ["message_id", "group"])
    stored = copies.select("stored_subject", "group").distinct().collect()
    return sorted({(parse_system_subject(r["stored_subject"])[1], r["group"]) for r in stored})


def _repair(settings: Settings, outbox_dbs, anomalies, messages) -> repairs.RedriveReport:
    report = repairs.RedriveReport()
    if settings.redrive:
        urls = {db.name: db.url for db in outbox_dbs}
        ids: dict[str, list[str]] = {}
        for row in anomalies.where(F.col("class") == NOT_SHIPPED).select("database", "message_id").toLocalIterator():
            ids.setdefault(row["database"], []).append(row["message_id"])
        repairs.redrive_outbox(urls, ids, report)
    if settings.redrive_dead:
        repairs.redrive_dead(_dead_letter_pairs(anomalies, messages), settings.brokers, settings.meta, None, report)
    return report
