"""The classification: every message of the window gets one class and, when it is an anomaly, the
reason in words. Pure DataFrame transformations (no I/O, no Python UDFs, so executors need nothing
but Spark).

Classes, the first that applies (docs/reconcile.md has the long version):

- `rolled_back` (critical): on a broker, produced by an outbox (its `qmq-producer` header), with no
  outbox row: a rolled-back transaction's message, which qmq promises never exists.
- `cancelled`: a delayed message cancelled before it was due.
- `in_flight`: not settled yet, and young: made within the grace period before the ledger's export,
  or not yet due in a delay server.
- `not_shipped`: committed in an outbox, stored on no broker.
- `orphaned` (never stored): no outbox row, held by a delay server past its due time.
- `dead_lettered`: a consumer group dead-lettered it (and has not taken it back).
- `not_acked`: stored, and some group that consumes its subject has not acknowledged it.
- `redelivered`: every group acknowledged it, but one received it more than once.
- `orphaned`: stored with no outbox row: sent outside a transaction (reported, not alarmed).
- `delivered`: stored and acknowledged once by every group that consumes its subject.

A group consumes a subject from its first pull on a broker (the earliest over brokers), broadcast
consumers and groups given as ignored aside; a message stored before a group existed is not
expected of it, unless the group received it anyway.

Three steps, shaped for tens of millions of messages on a few cores: `pairs` (one row per message
and group, from the ledger), `classify` (one row per message: the outbox, the ledger and the pairs'
counts side by side), `explain` (the groups concerned and the reason in words, for the few messages
that need one). The big steps aggregate only numbers (Spark's hash aggregation; strings ride in the
grouping keys), and only the few anomalies are joined back to the details.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F

from qmq.ledger import tables as lt

DELIVERED, NOT_SHIPPED, NOT_ACKED, DEAD_LETTERED = "delivered", "not_shipped", "not_acked", "dead_lettered"
REDELIVERED, ORPHANED, IN_FLIGHT, CANCELLED, ROLLED_BACK = (
    "redelivered",
    "orphaned",
    "in_flight",
    "cancelled",
    "rolled_back",
)
CLASSES = (DELIVERED, NOT_SHIPPED, NOT_ACKED, DEAD_LETTERED, REDELIVERED, ORPHANED, IN_FLIGHT, CANCELLED, ROLLED_BACK)
ANOMALIES = (ROLLED_BACK, NOT_SHIPPED, DEAD_LETTERED, NOT_ACKED, REDELIVERED, ORPHANED)
CRITICAL = (ROLLED_BACK,)
OUTBOX_PRODUCER = "outbox"  # the PRODUCER_HEADER of an outbox: "outbox" or "outbox:<database>"
NEVER = "never delivered"
TIME_FORMAT = "yyyy-MM-dd HH:mm:ss'Z'"
# Per-message counts of the ledger; a message the ledger never saw has 0 of each.
COUNT_COLUMNS = (
    "stored_copies",
    "groups",
    "groups_acked",
    "groups_unacked",
    "groups_dead",
    "groups_redelivered",
    "times_delivered",
)


@dataclass(frozen=True)
class Window:
    since: datetime
    until: datetime
    cutoff: datetime  # the ledger's as-of time less the grace period: anything younger may be in flight
    outbox_names: tuple[str, ...]  # the databases read, as a producer header names them
    ignore_groups: tuple[str, ...] = ()


@dataclass
class Sources:
    outbox: DataFrame
    messages: DataFrame
    deliveries: DataFrame
    groups: DataFrame
    delayed: DataFrame
    consumed: DataFrame | None = None


def _in(col: Column, window: Window) -> Column:
    return (col >= F.lit(window.since)) & (col < F.lit(window.until))


def _time(col: Column) -> Column:
    return F.date_format(col, TIME_FORMAT)


def _not_ignored(window: Window, column: str = "group") -> Column:
    return ~F.col(column).isin(list(window.ignore_groups)) if window.ignore_groups else F.lit(True)


def pairs(src: Sources, window: Window) -> DataFrame:
    """(message, subject, group) for every group expected to consume a message (its subject's groups
    that existed when it was stored) or that received it: `expected` (0/1), `times_delivered` (summed
    over brokers), `state` (acked, dead, retrying, in_flight or never delivered), `attempts` (the
    highest), `consumed_at` (its idempotency record, if one was read)."""
    epoch = F.lit(datetime.fromtimestamp(0, window.since.tzinfo))
    groups = (
        src.groups.where(~F.col("broadcast") & _not_ignored(window))
        .groupBy("subject", "group")
        .agg(F.min(F.coalesce("created_at", epoch)).alias("since"))
    )
    status = F.col("status")
    parts = [
        src.messages.where(F.col("origin") == lt.PRODUCER)
        .select("message_id", "subject", "stored_at")
        .join(F.broadcast(groups), "subject")
        .where(F.col("since") <= F.col("stored_at"))
        .select(
            "message_id",
            "subject",
            "group",
            F.lit(1).alias("expected"),
            F.lit(None).cast("timestamp").alias("consumed_at"),
        ),
        src.deliveries.where(~F.col("broadcast") & _not_ignored(window)).select(
            "message_id",
            "subject",
            "group",
            "times_delivered",
            "attempts",
            (status == lt.ACKED).cast("int").alias("acked"),
            (status == lt.DEAD_LETTERED).cast("int").alias("dead"),
            (status == lt.RETRYING).cast("int").alias("retrying"),
        ),
    ]
    if src.consumed is not None:
        parts.append(
            src.consumed.where(_not_ignored(window, "consumer_group")).select(
                "message_id", "subject", F.col("consumer_group").alias("group"), "consumed_at"
            )
        )
    side_by_side = parts[0]
    for part in parts[1:]:
        side_by_side = side_by_side.unionByName(part, allowMissingColumns=True)
    found = side_by_side.groupBy("message_id", "subject", "group").agg(
        F.coalesce(F.max("expected"), F.lit(0)).alias("expected"),
        F.coalesce(F.sum("times_delivered"), F.lit(0)).cast("int").alias("times_delivered"),
        F.max("acked").alias("acked"),
        F.max("dead").alias("dead"),
        F.max("retrying").alias("retrying"),
        F.max("attempts").alias("attempts"),
        F.min("consumed_at").alias("consumed_at"),
    )
    state = (
        F.when(F.col("acked") == 1, lt.ACKED)
        .when(F.col("dead") == 1, lt.DEAD_LETTERED)
        .when(F.col("retrying") == 1, lt.RETRYING)
        .when(F.col("times_delivered") > 0, lt.IN_FLIGHT)
        .otherwise(NEVER)
    )
    return found.where((F.col("expected") == 1) | (F.col("times_delivered") > 0)).select(  # not a bare consumed record
        "message_id", "subject", "group", "expected", "times_delivered", state.alias("state"), "attempts", "consumed_at"
    )


def _unacked(state: Column) -> Column:
    return state.isin(lt.IN_FLIGHT, lt.RETRYING, NEVER)


def classify(src: Sources, window: Window, group_pairs: DataFrame) -> DataFrame:
    """Every message of the window with its class, beside what its reason will need."""
    outbox = src.outbox.select(
        "message_id",
        "database",
        F.col("subject").alias("o_subject"),
        F.col("state").alias("outbox_state"),
        "attempts",
        F.col("created_at").alias("o_created_at"),
        "sent_at",
        "flagged_at",
        "last_error",
        F.col("deliver_at").alias("o_deliver_at"),
    )
    originals = (
        src.messages.where(F.col("origin") == lt.PRODUCER)
        .groupBy("message_id", F.col("subject").alias("l_subject"), F.col("producer").alias("l_producer"))
        .agg(
            F.count(F.lit(1)).alias("stored_copies"),
            F.min("stored_at").alias("stored_at"),
            F.min("created_at").alias("l_created_at"),
        )
    )
    delayed = src.delayed.groupBy("message_id").agg(  # a delay server's messages: few beside the rest
        F.first("subject").alias("d_subject"),
        F.min("due_at").alias("d_due_at"),
        F.max("dispatched").alias("dispatched"),
        F.max("cancelled").alias("cancelled"),
        F.min("stored_at").alias("d_stored_at"),
        F.min("created_at").alias("d_created_at"),
        F.max("producer").alias("d_producer"),
        F.sort_array(F.collect_set(lt.SERVER)).alias("delay_servers"),
    )
    state = F.col("state")
    counts = group_pairs.groupBy("message_id").agg(
        F.count(F.lit(1)).alias("groups"),
        F.count_if(state == lt.ACKED).alias("groups_acked"),
        F.count_if(_unacked(state)).alias("groups_unacked"),
        F.count_if(state == lt.DEAD_LETTERED).alias("groups_dead"),
        F.count_if(F.col("times_delivered") > 1).alias("groups_redelivered"),
        F.max("times_delivered").alias("times_delivered"),
    )
    made = F.coalesce("o_created_at", "l_created_at", "d_created_at", "stored_at", "d_stored_at")
    in_window = F.when(F.col("database").isNotNull(), _in(F.col("o_created_at"), window)).otherwise(_in(made, window))
    rows = (
        outbox.join(originals, "message_id", "full_outer")
        .join(delayed, "message_id", "full_outer")
        .where(in_window)
        .join(counts, "message_id", "left")
    )
    for name in COUNT_COLUMNS:
        rows = rows.withColumn(name, F.coalesce(F.col(name), F.lit(0)))
    # When a delayed message is due: as its delay server has it, or as its outbox row says once shipped.
    due = F.coalesce(F.col("d_due_at"), F.when(F.col("outbox_state") == "sent", F.col("o_deliver_at")))
    rows = (
        rows.withColumn("created_at", made)
        .withColumn("due_at", due)
        .withColumn("subject", F.coalesce("o_subject", "l_subject", "d_subject"))
        .withColumn("producer", F.coalesce("l_producer", "d_producer"))
    )
    stored = F.col("stored_copies") > 0
    in_outbox = F.col("database").isNotNull()
    producer = F.coalesce(F.col("producer"), F.lit(""))
    names = (
        F.array(*[F.lit(n) for n in window.outbox_names]) if window.outbox_names else F.array().cast("array<string>")
    )
    from_outbox = (producer == OUTBOX_PRODUCER) | (
        producer.startswith(OUTBOX_PRODUCER + ":") & F.array_contains(names, F.substring_index(producer, ":", -1))
    )
    recent = F.col("created_at") >= F.lit(window.cutoff)
    delayed_message = F.col("due_at").isNotNull()
    cancelled = delayed_message & F.coalesce(F.col("cancelled"), F.lit(False))
    not_due = (
        delayed_message & ~F.coalesce(F.col("dispatched"), F.lit(False)) & (F.col("due_at") >= F.lit(window.cutoff))
    )
    cls = (
        F.when(~in_outbox & from_outbox & (stored | delayed_message), ROLLED_BACK)
        .when(~stored & cancelled, CANCELLED)
        .when(~stored & (recent | not_due), IN_FLIGHT)
        .when(~stored & in_outbox, NOT_SHIPPED)
        .when(~stored, ORPHANED)
        .when(F.col("groups_dead") > 0, DEAD_LETTERED)
        .when((F.col("groups_unacked") > 0) & recent, IN_FLIGHT)
        .when(F.col("groups_unacked") > 0, NOT_ACKED)
        .when(F.col("groups_redelivered") > 0, REDELIVERED)
        .when(~in_outbox, ORPHANED)
        .otherwise(DELIVERED)
    )
    rows = rows.withColumn("not_due", ~stored & not_due).withColumn("class", cls)
    return rows.select(
        "message_id",
        "class",
        F.col("class").isin(*CRITICAL).alias("critical"),
        "subject",
        "database",
        "outbox_state",
        "created_at",
        "stored_at",
        *COUNT_COLUMNS,
        "attempts",
        "sent_at",
        "flagged_at",
        "last_error",
        "due_at",
        "not_due",
        "delay_servers",
        "producer",
    )


def _unacked_detail(p: Column) -> Column:
    """Why one group has not acknowledged: its state, deliveries, and the idempotency record if any."""
    what = (
        F.when(p["state"] == NEVER, F.lit(NEVER))
        .when(p["state"] == lt.RETRYING, F.concat(F.lit("retrying after attempt "), p["attempts"]))
        .otherwise(F.concat(F.lit("delivered "), p["times_delivered"], F.lit("x, never acknowledged")))
    )
    handled = F.when(
        p["consumed_at"].isNotNull(),
        F.concat(F.lit("; handled at "), _time(p["consumed_at"]), F.lit(", the ack was lost")),
    )
    return F.concat(p["group"], F.lit(" ("), what, F.coalesce(handled, F.lit("")), F.lit(")"))


def _redelivered_detail(p: Column) -> Column:
    """How often one group received a message: retries after failures, and repeats (duplicates)."""
    retries = F.coalesce(p["attempts"], F.lit(1)) - 1
    return F.concat(
        p["group"],
        F.lit(" "),
        p["times_delivered"],
        F.lit("x"),
        F.when(retries > 0, F.concat(F.lit(" ("), retries.cast("string"), F.lit(" after failures)"))).otherwise(
            F.lit("")
        ),
        F.when(p["consumed_at"].isNotNull(), F.lit(", the repeat absorbed by its idempotency record")).otherwise(
            F.lit("")
        ),
    )


def explain(rows: DataFrame, group_pairs: DataFrame, src: Sources, window: Window) -> DataFrame:
    """`rows` (a few classified messages: the anomalies) with the groups concerned and the reason."""
    ids = F.broadcast(rows.select("message_id"))
    pair = F.struct("group", "state", "times_delivered", "attempts", "consumed_at")
    unacked, redelivered = _unacked(F.col("state")), F.col("times_delivered") > 1
    details = (
        group_pairs.join(ids, "message_id")
        .groupBy("message_id")
        .agg(
            F.sort_array(F.collect_list(F.when(F.col("state") == lt.DEAD_LETTERED, F.col("group")))).alias(
                "dead_groups"
            ),
            F.sort_array(F.collect_list(F.when(unacked, F.col("group")))).alias("unacked_groups"),
            F.sort_array(F.collect_list(F.when(redelivered, F.col("group")))).alias("redelivered_groups"),
            F.sort_array(F.collect_list(F.when(unacked, _unacked_detail(pair)))).alias("unacked_detail"),
            F.sort_array(F.collect_list(F.when(redelivered, _redelivered_detail(pair)))).alias("redelivered_detail"),
        )
    )
    brokers = (
        src.messages.where(F.col("origin") == lt.PRODUCER)
        .join(ids, "message_id")
        .groupBy("message_id")
        .agg(F.sort_array(F.collect_set(lt.BROKER)).alias("brokers"))
    )
    dead_reasons = (
        src.messages.where(F.col("origin") == lt.DEAD)
        .join(ids, "message_id")
        .groupBy("message_id")
        .agg(F.max_by("reason", "stored_at").alias("dead_reason"))
    )
    out = (
        rows.join(details, "message_id", "left")
        .join(brokers, "message_id", "left")
        .join(dead_reasons, "message_id", "left")
        .withColumn("delay_servers", F.coalesce("delay_servers", F.array(F.lit("a delay server"))))
        .withColumn("brokers", F.coalesce("brokers", "delay_servers"))
    )
    return out.select(
        "message_id",
        "class",
        "critical",
        "subject",
        "database",
        "outbox_state",
        "created_at",
        "stored_at",
        "brokers",
        _concerned().alias("groups"),
        "times_delivered",
        _reason(window).alias("reason"),
    )


def per_group(group_pairs: DataFrame, classified: DataFrame) -> DataFrame:
    """Per (subject, group): the window's messages it consumes (or received) and what became of them."""
    state = F.col("state")
    return (
        group_pairs.join(classified.select("message_id"), "message_id", "left_semi")
        .groupBy("subject", "group")
        .agg(
            F.count(F.lit(1)).alias("messages"),
            F.count_if(state == lt.ACKED).alias("acked"),
            F.count_if(_unacked(state)).alias("not_acked"),
            F.count_if(state == lt.DEAD_LETTERED).alias("dead"),
            F.count_if(F.col("times_delivered") > 1).alias("redelivered"),
        )
    )


def _concerned() -> Column:
    cls = F.col("class")
    empty = F.array().cast("array<string>")
    return (
        F.when(cls == DEAD_LETTERED, F.col("dead_groups"))
        .when(cls == NOT_ACKED, F.col("unacked_groups"))
        .when(cls == REDELIVERED, F.col("redelivered_groups"))
        .otherwise(empty)
    )


def _reason(window: Window) -> Column:
    cls = F.col("class")
    copies = F.when(
        F.col("stored_copies") > 1,
        F.concat(
            F.lit("; stored "), F.col("stored_copies"), F.lit(" times (on "), F.array_join("brokers", ", "), F.lit(")")
        ),
    ).otherwise(F.lit(""))
    pending = F.concat(
        F.lit("pending in "),
        F.col("database"),
        F.lit(" after "),
        F.col("attempts"),
        F.lit(" attempts"),
        F.coalesce(F.concat(F.lit(": "), F.col("last_error")), F.lit("")),
        F.coalesce(F.concat(F.lit("; flagged at "), _time(F.col("flagged_at"))), F.lit("")),
    )
    lost = F.concat(
        F.lit("marked sent in "),
        F.col("database"),
        F.lit(" at "),
        _time(F.col("sent_at")),
        F.lit(", but no broker stored it"),
    )
    overdue = F.when(
        F.col("due_at").isNotNull(),
        F.concat(F.lit("; due at "), _time(F.col("due_at")), F.lit(", still in "), F.array_join("delay_servers", ", ")),
    )
    return (
        F.when(
            cls == ROLLED_BACK,
            F.concat(
                F.lit("on a broker with no outbox row, though produced by "),
                F.col("producer"),
                F.lit(": a rolled-back transaction's message"),
            ),
        )
        .when(
            cls == NOT_SHIPPED,
            F.concat(F.when(F.col("outbox_state") == "sent", lost).otherwise(pending), F.coalesce(overdue, F.lit(""))),
        )
        .when(
            cls == DEAD_LETTERED,
            F.concat(
                F.lit("dead-lettered by "),
                F.array_join("dead_groups", ", "),
                F.coalesce(F.concat(F.lit(": "), F.col("dead_reason")), F.lit("")),
            ),
        )
        .when(cls == NOT_ACKED, F.concat(F.lit("not acknowledged by "), F.array_join("unacked_detail", "; "), copies))
        .when(
            cls == REDELIVERED,
            F.concat(F.lit("received more than once by "), F.array_join("redelivered_detail", "; "), copies),
        )
        .when(
            (cls == ORPHANED) & (F.col("stored_copies") == 0),
            F.concat(F.lit("no outbox row, and never stored on a broker"), F.coalesce(overdue, F.lit(""))),
        )
        .when(cls == ORPHANED, F.lit("stored with no outbox row: sent outside a transaction"))
        .when(
            (cls == IN_FLIGHT) & F.col("not_due"),
            F.concat(F.lit("due at "), _time(F.col("due_at")), F.lit(" in "), F.array_join("delay_servers", ", ")),
        )
        .when(
            cls == IN_FLIGHT,
            F.concat(
                F.lit("made at "),
                _time(F.col("created_at")),
                F.lit(f", within the grace period before the ledger's export ({window.cutoff:%Y-%m-%d %H:%M:%SZ})"),
            ),
        )
    )
